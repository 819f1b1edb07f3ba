"""Rank workers of tests/test_mixed_precision.py (run by dist_harness.run_ranks as "precision_workers:<name>").

Mixed precision (bf16 autocast; fp16 autocast with ``torch.amp.GradScaler``) and gradient
checkpointing (reentrant and not) in a plain training loop over an odb loader, under DDP
on real gloo ranks or in one process (the same functions, ``world=1``, no DDP).

Data: rank 0 holds long samples (20..40 tokens), rank 1 a few short ones (2..8), so rank 1
runs out first and runs ghost steps (a real sample of its own with ``loss_scale=0``), and
the two ranks' micro-batches hold very different token counts: a loss scaled by the local
instead of the global token count is far from the exact gradient. In one process the
rank-0 and rank-1 samples are one shard.

Every optimizer step records the parameters before it, the gradient the optimizer sees
(after ``scaler.unscale_`` with fp16) and the sample ids of every rank's micro-batches; the
test recomputes that gradient without odb (``reference_grads``, the same precision and
scaler) over the union of the ids and compares.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import odb
from helpers import IGNORE, known_lengths, make_sample, pad_collate

VOCAB = 50  # helpers.make_sample draws ids below 50
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # precision -> autocast dtype; else no autocast
PARAM_DTYPE = {"bf16": torch.float32, "fp16": torch.float32, "fp32": torch.float32, "fp64": torch.float64}


# ---- data ----------------------------------------------------------------------------------


def shard_lengths(p: Dict[str, Any]) -> List[int]:
    """Lengths of every sample: ``counts[0]`` long ones (rank 0's), then ``counts[1]`` short ones (rank 1's)."""
    return known_lengths(p["counts"][0], 20, 40, seed=21) + known_lengths(p["counts"][1], 2, 8, seed=22)


def shard(p: Dict[str, Any], rank: int, world: int) -> List[int]:
    n0, n1 = p["counts"]
    if world == 1:
        return list(range(n0 + n1))
    return list(range(n0)) if rank == 0 else list(range(n0, n0 + n1))


class Samples(torch.utils.data.Dataset):
    """helpers.make_sample's samples (labels: every third token from the second ignored)."""

    def __init__(self, lengths: Sequence[int]) -> None:
        self.lengths = list(lengths)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        return make_sample(int(index), self.lengths[index])


# ---- model and loss ------------------------------------------------------------------------


class TinyLM(torch.nn.Module):
    """Embedding, a two-layer MLP block (optionally gradient-checkpointed), a head: predicts each label."""

    def __init__(self, checkpointing: Optional[str] = None) -> None:
        super().__init__()
        if checkpointing not in (None, "reentrant", "non_reentrant"):
            raise ValueError(f"checkpointing={checkpointing!r}: use None, 'reentrant' or 'non_reentrant'")
        self.checkpointing = checkpointing
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.block = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 16))
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        if self.checkpointing is None:
            hidden = self.block(hidden)
        else:  # the block's activations are recomputed in backward
            hidden = checkpoint(self.block, hidden, use_reentrant=self.checkpointing == "reentrant")
        return self.head(hidden)


def make_model(precision: str, checkpointing: Optional[str] = None, seed: int = 0) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM(checkpointing).to(PARAM_DTYPE[precision])


def autocast(precision: str) -> Any:
    if precision in AUTOCAST:
        return torch.autocast("cpu", dtype=AUTOCAST[precision])
    return contextlib.nullcontext()


def token_loss(model: torch.nn.Module, batch: Dict[str, Any], precision: str, reduction: str) -> torch.Tensor:
    """Cross-entropy over the supervised tokens (``mean``: what a model returns; ``sum``), under autocast."""
    with autocast(precision):
        logits = model(batch["input_ids"])
        return F.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1), ignore_index=IGNORE,
                               reduction=reduction)


def scaled_loss(loss: torch.Tensor, info: odb.ODBStepInfo, recipe: str) -> torch.Tensor:
    """The loss a trainer backpropagates: ``scale_loss`` (odb's recipe) or ``multiply`` (loss x loss_scale);
    wrong recipes, so the tests can see them fail: ``unscaled`` (the loss scale forgotten) and ``divide``
    (each micro-batch's mean divided by the micro-batches of the step, as with fixed batches: a mean of
    micro-batch means, not the step's token mean)."""
    if recipe == "scale_loss":
        return odb.scale_loss(loss, info)
    if recipe == "multiply":
        return loss * info.loss_scale
    if recipe == "unscaled":
        return loss
    if recipe == "divide":
        return loss / info.micro_steps
    raise ValueError(f"recipe={recipe!r}: use 'scale_loss', 'multiply', 'unscaled' or 'divide'")


def clone_all(tensors: Any) -> List[torch.Tensor]:
    return [t.detach().clone() for t in tensors]


# ---- training ------------------------------------------------------------------------------


def arm_name(arm: Dict[str, Any]) -> str:
    return "/".join(f"{k}={arm[k]}" for k in sorted(arm))


def train(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """Each arm of ``p["arms"]`` trained for one epoch; per optimizer step what reference_grads needs.

    An arm: ``precision`` (bf16, fp16, fp32, fp64), ``recipe`` (scaled_loss), ``loss_scaling`` (odb's
    option: ``exact``, or ``approx``: the local token count), ``accumulation`` (micro-batches per
    optimizer step), ``checkpointing`` (TinyLM's). fp16 runs with a GradScaler: each micro-batch
    backpropagates ``scaler.scale(loss)``, the last one ``unscale_``s before the gradient is read.
    """
    ds = Samples(shard_lengths(p))
    out: Dict[str, List[Dict[str, Any]]] = {}
    for arm in p["arms"]:
        loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=shard(p, rank, world),
                                   buffer_size=p["buffer"], collate_fn=pad_collate, seed=0, shift_labels=False,
                                   gradient_accumulation_steps=arm["accumulation"],
                                   loss_scaling=arm["loss_scaling"])
        net = make_model(arm["precision"], arm.get("checkpointing"))
        model = DDP(net) if dist.is_initialized() else net
        opt = torch.optim.SGD(model.parameters(), lr=p["lr"])
        scaler = torch.amp.GradScaler("cpu") if arm["precision"] == "fp16" else None
        steps: List[Dict[str, Any]] = []
        ids: List[int] = []
        micro: List[Dict[str, Any]] = []
        before = clone_all(net.parameters())
        for batch in loader:
            info = odb.pop_step_info(batch)
            loss = scaled_loss(token_loss(model, batch, arm["precision"], "mean"), info, arm["recipe"])
            sync = contextlib.nullcontext() if info.is_last_micro_step or model is net else model.no_sync()
            with sync:
                (scaler.scale(loss) if scaler else loss).backward()
            ids += list(info.sample_ids)
            micro.append({"ghost": info.is_ghost, "scale": info.loss_scale, "local": info.local_loss_tokens,
                          "global": info.global_loss_tokens, "logged": float(loss.detach())})
            if not info.is_last_micro_step:
                continue
            record: Dict[str, Any] = {"params": before, "ids": ids, "micro": micro}
            if scaler:
                record["scale"] = scaler.get_scale()
                scaler.unscale_(opt)
                record["grads"] = clone_all(t.grad for t in net.parameters())
                scaler.step(opt)   # skipped if unscale_ found an inf or NaN
                scaler.update()    # halves the scale if it did
                record["scale_after"] = scaler.get_scale()
            else:
                record["grads"] = clone_all(t.grad for t in net.parameters())
                opt.step()
            opt.zero_grad(set_to_none=False)
            before = clone_all(net.parameters())
            record["stepped"] = any(not torch.equal(a, b) for a, b in zip(record["params"], before))
            steps.append(record)
            ids, micro = [], []
        assert not micro, "the epoch ended inside an optimizer step"
        out[arm_name(arm)] = steps
    return out


def reference_grads(p: Dict[str, Any], arm: Dict[str, Any], step: Dict[str, Any]) -> List[torch.Tensor]:
    """Without odb, one process, the arm's precision and checkpointing, from the parameters before ``step``:
    the gradient of (sum of per-token losses over every sample of the step) / (their supervised tokens),
    computed on one batch of all of them. fp16: backpropagated through a GradScaler at the step's scale
    and unscaled by it, as the training loop did."""
    ds = Samples(shard_lengths(p))
    model = make_model(arm["precision"], arm.get("checkpointing"))
    with torch.no_grad():
        for t, value in zip(model.parameters(), step["params"]):
            t.copy_(value)
    batch = pad_collate([ds[i] for i in step["ids"]])
    total = int((batch["labels"] != IGNORE).sum())
    loss = token_loss(model, batch, arm["precision"], "sum") / total
    if arm["precision"] == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=step["scale"])
        scaler.scale(loss).backward()
        scaler.unscale_(torch.optim.SGD(model.parameters(), lr=0.0))
    else:
        loss.backward()
    return clone_all(t.grad for t in model.parameters())
