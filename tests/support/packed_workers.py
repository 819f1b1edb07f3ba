"""The packed layout with a real HF Llama: models, samples and the per-rank DDP worker.

``packed_grads`` runs on every rank under dist_harness.run_ranks (worker name
``"packed_workers:packed_grads"``); the parent rebuilds the same model and samples here
to compute the single-process reference. Everything is module-level so the ranks and
the parent agree on it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import odb
from helpers import IGNORE, LengthDataset, make_sample

VOCAB = 50  # helpers.make_sample draws ids below 50


def tiny_llama(attn: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    """A 2-layer Llama with random weights (from a config: nothing is downloaded); attn may be "odb_varlen"."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if attn == "odb_varlen":
        odb.register_varlen_attention()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation=attn)
    return LlamaForCausalLM(config).to(dtype)


def shard_lengths(p: Dict[str, Any]) -> List[int]:
    """Rank 0: many long samples; rank 1: a few short ones (so rank 1 runs ghost steps)."""
    rng = np.random.default_rng(p["seed"])
    return rng.integers(20, 61, size=p["counts"][0]).tolist() + rng.integers(4, 9, size=p["counts"][1]).tolist()


def shards(p: Dict[str, Any]) -> List[List[int]]:
    n0, n1 = p["counts"]
    return [list(range(n0)), list(range(n0, n0 + n1))]


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """The loss of an HF causal LM (labels shifted inside: token t predicts label t + 1), in the logits'
    dtype (transformers' own loss computes in float32, which would cap a float64 comparison at ~1e-7)."""
    return torch.nn.functional.cross_entropy(logits[..., :-1, :].reshape(-1, logits.shape[-1]),
                                             labels[..., 1:].reshape(-1), ignore_index=IGNORE, reduction=reduction)


def sample_loss_sum(model: Any, index: int, length: int) -> torch.Tensor:
    """Sum of the token losses of one sample run alone."""
    s = make_sample(index, length)
    return causal_lm_loss(model(input_ids=s["input_ids"][None]).logits, s["labels"][None], "sum")


def reference_grads(attn: str, p: Dict[str, Any], ids: Sequence[int]) -> List[torch.Tensor]:
    """One process, no packing: gradient of (sum of token losses over ``ids``) / (their count), float64."""
    lengths = shard_lengths(p)
    model = tiny_llama(attn, p["seed"], torch.float64)
    total = sum(int((make_sample(i, lengths[i])["labels"][1:] != IGNORE).sum()) for i in ids)
    loss = sum(sample_loss_sum(model, i, lengths[i]) for i in ids) / total
    loss.backward()
    return [t.grad.detach().clone() for t in model.parameters()]


def packed_grads(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Per run (attention implementation, accumulation): each optimizer step's DDP gradient and sample ids."""
    lengths = shard_lengths(p)
    out: Dict[str, Any] = {}
    for attn, k in p["runs"]:
        loader = odb.ODBDataLoader(LengthDataset(lengths), token_budget=p["budget"], layout="packed",
                                   sampler=shards(p)[rank], buffer_size=16, first_window_size=8, seed=0,
                                   gradient_accumulation_steps=k)
        model = DDP(tiny_llama(attn, p["seed"], torch.float64))
        steps, ids, micro = [], [], []
        for batch in loader:
            info = odb.pop_step_info(batch)
            ids += list(info.sample_ids)
            micro.append({"ghost": info.is_ghost, "rows": int(batch["input_ids"].shape[0]),
                          "tokens": int(batch["input_ids"].shape[1])})
            sync = contextlib.nullcontext() if info.is_last_micro_step else model.no_sync()
            with sync:
                result = model(**batch)
                loss = causal_lm_loss(result.logits, batch["labels"])
                # The model's own loss is the same mean over the row's supervised tokens (in float32).
                assert abs(float(result.loss) - float(loss)) <= 1e-6 * max(1.0, abs(float(loss)))
                (loss * info.loss_scale).backward()
            if info.is_last_micro_step:
                steps.append({"grads": [t.grad.detach().clone() for t in model.parameters()], "ids": ids,
                              "micro": micro})
                ids, micro = [], []
                model.zero_grad(set_to_none=False)
        out[f"{attn}-{k}"] = steps
    return out
