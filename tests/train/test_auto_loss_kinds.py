"""token_budget="auto" with a real tiny causal LM on CPU, its activation memory measured (ActivationMeter):
the budget the fitted model proposes keeps the measured peak under the cap with a plain cross-entropy
(logits for every token) and with a chunked loss (logits for supervised tokens only), issue 26.

The chunked loss follows the rule of TRL 1.16's fused LM head on a Triton device (``add_fused_lm_head``:
only positions whose next-token label is not -100 are projected, in chunks of tokens); unlike TRL's
kernel it keeps each chunk's log-probabilities for backward (autograd's own cross-entropy), so its
memory is ~ supervised tokens x vocabulary x 4 bytes: the term the memory model must see.
"""

from __future__ import annotations

from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from odb.plan.auto.auto_budget import AutoBudget
from odb.plan.windows.planner import plan_window
from odb.plan.auto.step_model import shape_features
from odb.train.memory import ActivationMeter

from hf_workers import pad_collate

transformers = pytest.importorskip("transformers")

VOCAB = 8192
CAP = 16 * 2 ** 20  # bytes of activations a step may save
CHUNK = 256  # supervised tokens per projection chunk


class Step(torch.nn.Module):
    """A causal LM and its loss in one forward, so that the meter sees what the loss saves."""

    def __init__(self, chunked: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                                       attn_implementation="eager")
        self.lm = transformers.LlamaForCausalLM(cfg)
        self.chunked = chunked

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if not self.chunked:  # HF's own cross-entropy over every position's logits
            return self.lm(input_ids=input_ids, attention_mask=attention_mask, labels=labels).loss
        hidden = self.lm.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state[:, :-1]
        target = labels[:, 1:]
        mask = target != -100
        total = hidden.new_zeros(())
        for h, t in zip(hidden[mask].split(CHUNK), target[mask].split(CHUNK)):
            total = total + F.cross_entropy(self.lm.lm_head(h).float(), t, reduction="sum")
        return total / mask.sum().clamp(min=1)


def _samples(rng: np.random.Generator, n: int) -> List[Dict[str, Any]]:
    """Prompt-completion samples: random lengths, a random share of each masked as prompt (-100)."""
    out = []
    for _ in range(n):
        length = int(rng.integers(16, 240))
        ids = torch.from_numpy(rng.integers(0, VOCAB, length))
        labels = ids.clone()
        labels[:int(rng.uniform(0.0, 0.95) * length)] = -100
        out.append({"input_ids": ids, "labels": labels})
    return out


def _run(chunked: bool, steps: int = 30) -> Dict[str, Any]:
    """Windows planned under each proposal, every step measured and fed back."""
    rng = np.random.default_rng(0)
    model = Step(chunked)
    auto = AutoBudget(CAP, 256)
    peaks, tokens, fitted_at = [], [], None
    with ActivationMeter(model) as meter:
        while len(peaks) < steps:
            plan = auto.propose()
            if fitted_at is None and auto.memory.fitted:
                fitted_at = len(peaks)
            window = _samples(rng, 8)
            lengths = np.array([len(s["input_ids"]) for s in window])
            supervised = np.array([int((s["labels"][1:] != -100).sum()) for s in window])
            side = np.stack([np.zeros_like(supervised), supervised], axis=1)
            for g in plan_window(lengths, np.arange(len(window)), plan.cost_model(), final=True, patches=side).groups:
                model(**pad_collate([window[i] for i in g])).backward()
                model.zero_grad(set_to_none=True)
                peaks.append(meter())
                tokens.append(int(lengths[g].sum()))
                auto.observe(shape_features(lengths[g], supervised=supervised[g]), peak=peaks[-1])
    return {"peaks": np.array(peaks), "tokens": np.array(tokens), "fitted_at": fitted_at,
            "coef": auto.memory.coefficients(), "plan": auto.last_plan}


@pytest.fixture
def one_thread():
    """One intra-op thread: on a shared 2-core machine torch's two threads make this test 4x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.timeout(240)
def test_auto_keeps_the_measured_peak_under_the_cap_with_a_plain_and_a_chunked_loss(one_thread):
    plain, chunked = _run(False), _run(True)
    logits_bytes = VOCAB * 4  # one token's fp32 log-probabilities
    for run in (plain, chunked):
        assert run["fitted_at"] is not None and run["fitted_at"] < 12
        assert run["peaks"].max() <= CAP, (run["peaks"].max() / CAP)
        assert run["peaks"][run["fitted_at"]:].max() >= 0.6 * CAP  # the fitted budget uses the memory
    # plain: every token's logits, in the per-token term; chunked: the supervised tokens' own term
    assert plain["coef"]["tokens"] >= 0.9 * logits_bytes
    assert plain["coef"]["supervised_tokens"] <= 0.1 * logits_bytes and plain["plan"].loss_token_cost <= 0.1
    assert 0.8 * logits_bytes <= chunked["coef"]["supervised_tokens"] <= 1.3 * logits_bytes
    assert chunked["coef"]["tokens"] <= 0.2 * logits_bytes and chunked["plan"].loss_token_cost >= 5.0
    # and the chunked loss packs more tokens into each step under the same cap
    assert chunked["tokens"][chunked["fitted_at"]:].mean() >= 1.3 * plain["tokens"][plain["fitted_at"]:].mean()
