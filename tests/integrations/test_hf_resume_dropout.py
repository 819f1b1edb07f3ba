"""HF Trainer resume is bitwise equal to the uninterrupted run for models with dropout (1 and 2 processes).

Dropout draws from torch's global RNG on every training step, so the resumed run must
continue with exactly the RNG states the interrupted run had after the checkpoint's
step. The Trainer restores them from ``rng_state*.pth`` before it builds the resumed
epoch's iterator, and building an iterator draws from that RNG (a DataLoader draws its
base seed at ``iter()``); odb restores them again once the iterator is built. The
models are the tiny float64 T5 (dropout in every layer) and Llama (attention dropout)
of hf_workers.py; the 2-rank runs use real gloo processes (tests/support/dist_harness.py).
"""

from __future__ import annotations

import os
from typing import Any, Dict

import pytest
import torch

import accelerate  # noqa: F401  (pinned under `make test` and test-min: a broken install fails, never skips)
import hf_workers as W
import transformers  # noqa: F401
from dist_harness import run_ranks

SAVE_EVERY_2 = dict(save_strategy="steps", save_steps=2, optim="adamw_torch", lr_scheduler_type="linear",
                    warmup_steps=1)


def run_params(model: str, out: str, **kw: Any) -> Dict[str, Any]:
    p = dict(model=model, dropout=0.1, n=32, ga=2, lr=1e-2, budget=120 if model == "t5" else 60, max_steps=-1,
             epochs=2, out=out, args=dict(SAVE_EVERY_2))
    p.update(kw)
    return p


def assert_bitwise(whole: Dict[str, torch.Tensor], resumed: Dict[str, torch.Tensor], what: str) -> None:
    assert whole.keys() == resumed.keys()
    differ = {n: (whole[n] - resumed[n]).abs().max().item() for n in whole if not torch.equal(whole[n], resumed[n])}
    assert not differ, f"{what}: {len(differ)} of {len(whole)} parameters differ, e.g. {list(differ.items())[:3]}"


@pytest.mark.parametrize("model,workers", [("t5", 0), ("llama", 2)])
def test_resume_with_dropout_is_bitwise_equal(tmp_path, model, workers):
    out = str(tmp_path / "whole")
    p = run_params(model, out)
    p["args"]["dataloader_num_workers"] = workers
    whole = W.train_ranks(0, 1, p)
    epochs = [e for (_, e, _, _) in whole["steps"]]
    end_of_epoch = max(step for step, e in enumerate(epochs, 1) if e <= 1.0)
    # checkpoints every 2 steps: mid first epoch, the first epoch's last step (or the one before), mid second
    mid_second = next(s for s in range(end_of_epoch + 1, len(epochs)) if s % 2 == 0 and epochs[s - 1] > 1.0)
    checkpoints = (2, end_of_epoch - end_of_epoch % 2, mid_second)
    assert epochs[1] < 1.0 and 1.0 < epochs[mid_second - 1] < 2.0
    for at in checkpoints:
        tail = W.train_ranks(0, 1, dict(p, out=str(tmp_path / f"resumed{at}"),
                                        resume=os.path.join(out, f"checkpoint-{at}")))
        assert tail["steps"] == whole["steps"][at:], f"resumed at step {at} with other batches"
        assert_bitwise(whole["params"], tail["params"], f"{model}, resumed at step {at} of {len(epochs)}")


def noisy_collate(samples):
    """pad_collate, then 20% of the real input tokens replaced by token 1, drawn from torch's global RNG."""
    batch = W.pad_collate(samples)
    noise = (torch.rand(batch["input_ids"].shape) < 0.2) & (batch["attention_mask"] > 0)
    batch["input_ids"] = batch["input_ids"].masked_fill(noise, 1)
    return batch


def train_with_collate(p: Dict[str, Any], collate: Any) -> Dict[str, Any]:
    trainer = W.build_trainer(p, p["out"])
    trainer.data_collator = collate
    rec = W.recorder(trainer)
    trainer.train(resume_from_checkpoint=p.get("resume"))
    return {"steps": rec.steps, "params": {n: w.detach().clone() for n, w in trainer.model.named_parameters()}}


def test_resume_with_a_random_collator_on_the_training_thread_is_bitwise_equal(tmp_path):
    # ready_batches=0: odb collates on the training thread, so the collator's draws and dropout's come in a
    # fixed order; the resumed run restores the RNG states before its first batch is collated.
    out = str(tmp_path / "whole")
    p = run_params("llama", out, epochs=1, odb={"ready_batches": 0})
    whole = train_with_collate(p, noisy_collate)
    for at in (2, 4):
        tail = train_with_collate(dict(p, out=str(tmp_path / f"resumed{at}"),
                                       resume=os.path.join(out, f"checkpoint-{at}")), noisy_collate)
        assert tail["steps"] == whole["steps"][at:], f"resumed at step {at} with other batches"
        assert_bitwise(whole["params"], tail["params"], f"random collator, resumed at step {at}")


def test_dropout_is_active_in_these_runs(tmp_path):
    # The equality above means something only if dropout draws random masks: two RNG seeds, other weights.
    p = run_params("t5", str(tmp_path / "a"), epochs=1, args=dict(SAVE_EVERY_2, save_strategy="no", data_seed=7))
    first = W.train_ranks(0, 1, p)
    other = W.train_ranks(0, 1, dict(p, out=str(tmp_path / "b"), args=dict(p["args"], seed=8)))
    assert first["steps"] == other["steps"]  # the same batches (odb's seed is data_seed)...
    assert any(not torch.equal(first["params"][n], other["params"][n]) for n in first["params"])  # ...other masks


@pytest.mark.dist
def test_two_ranks_resume_with_dropout_is_bitwise_equal(tmp_path):
    runs = []
    for model in ("t5", "llama"):
        whole = str(tmp_path / f"{model}-whole")
        runs += [run_params(model, whole), run_params(model, str(tmp_path / f"{model}-resumed"),
                                                     resume=os.path.join(whole, "checkpoint-2"))]
    ranks = run_ranks("hf_workers:suite_ranks", 2, {"runs": runs}, tmp_path / "h", deadline_s=240)
    for k in (0, 2):
        model = runs[k]["model"]
        for rank, r in enumerate(ranks):
            whole, tail = r[k], r[k + 1]
            assert whole["steps"][1][1] < 1.0  # checkpoint-2 is mid-epoch
            assert tail["steps"] == whole["steps"][2:], f"{model}, rank {rank}: resumed with other batches"
            assert_bitwise(whole["params"], tail["params"], f"{model}, rank {rank}")
        # the ranks trained one model: DDP kept their parameters equal
        assert_bitwise(ranks[0][k]["params"], ranks[1][k]["params"], f"{model}, rank 0 against rank 1")


def test_a_transformers_without_load_rng_state_is_refused_with_the_fix(tmp_path, monkeypatch):
    # odb calls the Trainer's _load_rng_state(checkpoint) itself; a transformers without it (none is installed
    # here, hence the monkeypatch) is refused when odb is enabled, not at the first resume.
    from transformers import Trainer

    monkeypatch.delattr(Trainer, "_load_rng_state")
    with pytest.raises(RuntimeError, match=r"Trainer\._load_rng_state\(checkpoint\).* has no "
                                           r"Trainer\._load_rng_state.*Fix: pin the tested range"):
        W.build_trainer(run_params("llama", str(tmp_path)), str(tmp_path))
