"""Rank workers of tests/train/test_scale_loss.py (run by dist_harness.run_ranks as "loss_workers:<name>").

Every fourth sample of the dataset has no supervised token (all labels -100, as when
truncation cuts the answer away) and is longer than the others, so odb groups those
samples together: some micro-batches hold no supervised token at all.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Sequence

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

import odb
from helpers import IGNORE, known_lengths, make_sample, pad_collate

VOCAB = 50


def masked_lengths(n: int) -> List[int]:
    """Lengths: supervised samples 2..10 tokens, unsupervised ones (every fourth) 30..36."""
    short, long = known_lengths(n, 2, 10, seed=4), known_lengths(n, 30, 36, seed=5)
    return [long[i] if i % 4 == 3 else short[i] for i in range(n)]


class MaskedDataset(Dataset):
    """make_sample's samples; those with ``index % 4 == 3`` have every label ignored."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        sample = make_sample(int(index), self.lengths[index])
        if index % 4 == 3:
            sample["labels"] = torch.full_like(sample["labels"], IGNORE)
        return sample


def lm_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)).double()


def token_mean_loss(model: torch.nn.Module, batch: Dict[str, Any], kind: str) -> torch.Tensor:
    """The mean over the batch's supervised tokens: torch's cross-entropy mean, or sum / count."""
    logits = model(batch["input_ids"]).reshape(-1, VOCAB)
    labels = batch["labels"].reshape(-1)
    if kind == "torch":
        return F.cross_entropy(logits, labels, ignore_index=IGNORE)
    mask = (labels != IGNORE).to(logits.dtype)  # a custom loop's masked mean
    per_token = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
    return (per_token * mask).sum() / mask.sum()


def masked_training(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Per (loss kind, recipe, accumulation): each optimizer step's DDP gradient, ids and micro-batches."""
    lengths = masked_lengths(p["n"])
    ds = MaskedDataset(lengths)
    out: Dict[str, Any] = {}
    runs = [(kind, recipe, k) for kind in p["kinds"] for recipe in p["recipes"] for k in p["accumulation"]]
    for kind, recipe, k in runs:
        loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=list(range(rank, p["n"], world)),
                                   buffer_size=p["buffer"], collate_fn=pad_collate, seed=0,
                                   gradient_accumulation_steps=k)
        model = DDP(lm_model(0))
        steps, ids, micro = [], [], []
        for batch in loader:
            info = odb.pop_step_info(batch)
            loss = token_mean_loss(model, batch, kind)
            scaled = odb.scale_loss(loss, info) if recipe == "scale_loss" else loss * info.loss_scale
            sync = contextlib.nullcontext() if info.is_last_micro_step else model.no_sync()
            with sync:
                scaled.backward()
            ids += list(info.sample_ids)
            micro.append({"local": info.local_loss_tokens, "global": info.global_loss_tokens,
                          "ghost": info.is_ghost, "logged": float(scaled.detach())})
            if info.is_last_micro_step:
                steps.append({"grads": [t.grad.detach().clone() for t in model.parameters()], "ids": ids,
                              "micro": micro})
                ids, micro = [], []
                model.zero_grad(set_to_none=False)
        out[f"{kind}/{recipe}/{k}"] = steps
    return out


def reference_grads(p: Dict[str, Any], ids: Sequence[int]) -> List[torch.Tensor]:
    """One process: gradient of (sum of token losses over ``ids``) / (their supervised tokens); 0 if none."""
    ds = MaskedDataset(masked_lengths(p["n"]))
    model = lm_model(0)
    batch = pad_collate([ds[i] for i in ids])
    labels = batch["labels"].reshape(-1)
    total = int((labels != IGNORE).sum())
    if total == 0:
        return [torch.zeros_like(t) for t in model.parameters()]
    logits = model(batch["input_ids"]).reshape(-1, VOCAB)
    (F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum") / total).backward()
    return [t.grad.detach().clone() for t in model.parameters()]
