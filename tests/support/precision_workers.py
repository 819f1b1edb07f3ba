"""Rank workers of tests/train/test_mixed_precision.py (run by dist_harness.run_ranks as "precision_workers:<name>").

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
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import hf_workers
import odb
from helpers import IGNORE, known_lengths, make_sample, pad_collate

VOCAB = 50  # helpers.make_sample draws ids below 50
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}  # precision -> autocast dtype; else no autocast
PARAM_DTYPE = {"bf16": torch.float32, "fp16": torch.float32, "fp32": torch.float32, "fp64": torch.float64}


# ---- data ----------------------------------------------------------------------------------


def masked(p: Dict[str, Any], index: int) -> bool:
    """With ``p["masked"]``, every fourth of rank 0's samples has no supervised token (all labels ignored)."""
    return bool(p.get("masked")) and index < p["counts"][0] and index % 4 == 3


def shard_lengths(p: Dict[str, Any]) -> List[int]:
    """Lengths of every sample: ``counts[0]`` long ones (rank 0's: 20..40 tokens, 56..60 for the masked ones,
    so odb groups those together into micro-batches without supervised tokens), then ``counts[1]`` short
    ones (rank 1's: 2..8 tokens)."""
    n0, n1 = p["counts"]
    long, masked_long = known_lengths(n0, 20, 40, seed=21), known_lengths(n0, 56, 60, seed=23)
    return [masked_long[i] if masked(p, i) else long[i] for i in range(n0)] + known_lengths(n1, 2, 8, seed=22)


def shard(p: Dict[str, Any], rank: int, world: int) -> List[int]:
    n0, n1 = p["counts"]
    if world == 1:
        return list(range(n0 + n1))
    return list(range(n0)) if rank == 0 else list(range(n0, n0 + n1))


class Samples(torch.utils.data.Dataset):
    """helpers.make_sample's samples (labels: every third token from the second ignored; all of them
    for the masked samples of ``p``)."""

    def __init__(self, p: Dict[str, Any]) -> None:
        self.p = p
        self.lengths = shard_lengths(p)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        sample = make_sample(int(index), self.lengths[index])
        if masked(self.p, index):
            sample["labels"] = torch.full_like(sample["labels"], IGNORE)
        return sample


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
    """Cross-entropy over the supervised tokens, under autocast: ``mean`` (torch's, what a model returns),
    ``ratio`` (the same mean written as a custom loop's sum / count) or ``sum``."""
    with autocast(precision):
        logits = model(batch["input_ids"]).reshape(-1, VOCAB)
        labels = batch["labels"].reshape(-1)
        if reduction != "ratio":
            return F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction=reduction)
        mask = labels != IGNORE
        per_token = F.cross_entropy(logits, labels.clamp(min=0), reduction="none")
        return (per_token * mask).sum() / mask.sum()


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


def trainable(net: torch.nn.Module) -> List[torch.Tensor]:
    return [t for t in net.parameters() if t.requires_grad]


def epoch_steps(loader: Any, net: torch.nn.Module, loss_of: Callable[[torch.nn.Module, Dict[str, Any]], torch.Tensor],
                recipe: str, fp16: bool, lr: float) -> List[Dict[str, Any]]:
    """One epoch of a training loop (DDP around ``net`` when torch.distributed is up), SGD at ``lr``.

    ``loss_of(model, batch)`` is the micro-batch's mean loss; scaled_loss(recipe) scales it. With ``fp16``
    a GradScaler: each micro-batch backpropagates ``scaler.scale(loss)``, the last one of the optimizer
    step ``unscale_``s before the gradient is read, then ``scaler.step`` and ``update``. Per optimizer
    step: the parameters before it, the gradient, every micro-batch's ids and info, and whether it changed
    the parameters.
    """
    model = DDP(net) if dist.is_initialized() else net
    opt = torch.optim.SGD(trainable(net), lr=lr)
    scaler = torch.amp.GradScaler("cpu") if fp16 else None
    steps: List[Dict[str, Any]] = []
    ids: List[int] = []
    micro: List[Dict[str, Any]] = []
    before = clone_all(trainable(net))
    for batch in loader:
        info = odb.pop_step_info(batch)
        loss = scaled_loss(loss_of(model, batch), info, recipe)
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
            record["grads"] = clone_all(t.grad for t in trainable(net))
            scaler.step(opt)  # skipped if unscale_ found an inf or NaN
            scaler.update()  # halves the scale if it did
            record["scale_after"] = scaler.get_scale()
        else:
            record["grads"] = clone_all(t.grad for t in trainable(net))
            opt.step()
        opt.zero_grad(set_to_none=False)
        before = clone_all(trainable(net))
        record["stepped"] = any(not torch.equal(a, b) for a, b in zip(record["params"], before))
        steps.append(record)
        ids, micro = [], []
    assert not micro, "the epoch ended inside an optimizer step"
    return steps


def train(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """Each arm of ``p["arms"]`` trained for one epoch (epoch_steps) on TinyLM.

    An arm: ``precision`` (bf16, fp16, fp32, fp64), ``recipe`` (scaled_loss), ``loss_scaling`` (odb's
    option: ``exact``, or ``approx``: the local token count), ``accumulation`` (micro-batches per
    optimizer step), optionally ``checkpointing`` (TinyLM's) and ``loss`` (token_loss's reduction, default
    ``mean``).
    """
    ds = Samples(p)
    out: Dict[str, List[Dict[str, Any]]] = {}
    for arm in p["arms"]:
        loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=shard(p, rank, world),
                                   buffer_size=p["buffer"], collate_fn=pad_collate, seed=0, shift_labels=False,
                                   gradient_accumulation_steps=arm["accumulation"],
                                   loss_scaling=arm["loss_scaling"])
        net = make_model(arm["precision"], arm.get("checkpointing"))
        precision = arm["precision"]
        reduction = arm.get("loss", "mean")
        out[arm_name(arm)] = epoch_steps(loader, net, lambda m, b: token_loss(m, b, precision, reduction),
                                         arm["recipe"], precision == "fp16", p["lr"])
    return out


def load(net: torch.nn.Module, params: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for t, value in zip(trainable(net), params):
            t.copy_(value)


def reference_grads(p: Dict[str, Any], arm: Dict[str, Any], step: Dict[str, Any]) -> List[torch.Tensor]:
    """Without odb, one process, the arm's precision and checkpointing, from the parameters before ``step``:
    the gradient of (sum of per-token losses over every sample of the step) / (their supervised tokens),
    computed on one batch of all of them (zero where none is supervised). fp16: backpropagated through a
    GradScaler at the step's scale and unscaled by it, as the training loop did."""
    ds = Samples(p)
    model = make_model(arm["precision"], arm.get("checkpointing"))
    load(model, step["params"])
    batch = pad_collate([ds[i] for i in step["ids"]])
    total = int((batch["labels"] != IGNORE).sum())
    if total == 0:
        return [torch.zeros_like(t) for t in trainable(model)]
    loss = token_loss(model, batch, arm["precision"], "sum") / total
    if arm["precision"] == "fp16":
        scaler = torch.amp.GradScaler("cpu", init_scale=step["scale"])
        scaler.scale(loss).backward()
        scaler.unscale_(torch.optim.SGD(trainable(model), lr=0.0))
    else:
        loss.backward()
    return clone_all(t.grad for t in trainable(model))


# ---- a tiny HF Llama with HF's gradient checkpointing ---------------------------------------


class HFSamples(torch.utils.data.Dataset):
    """hf_workers.causal_sample's samples: rank 0's 12..24 tokens (56..60 without supervised tokens, every
    fourth with ``p["masked"]``), rank 1's 3..6."""

    def __init__(self, p: Dict[str, Any]) -> None:
        n0, n1 = p["counts"]
        long, masked_long = known_lengths(n0, 12, 24, seed=31), known_lengths(n0, 56, 60, seed=33)
        self.samples = [hf_workers.causal_sample(i, masked_long[i], True) if masked(p, i) else
                        hf_workers.causal_sample(i, long[i]) for i in range(n0)]
        self.samples += [hf_workers.causal_sample(n0 + i, k) for i, k in enumerate(known_lengths(n1, 3, 6, seed=32))]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return self.samples[index]


def hf_model(arm: Dict[str, Any]) -> torch.nn.Module:
    """hf_workers.llama (float64, random weights) with HF's gradient checkpointing, in training mode.

    ``frozen_embeddings``: the input embeddings are frozen, as with adapters; reentrant checkpointing then
    needs ``enable_input_require_grads()`` (without it no gradient enters the checkpointed layers, odb or
    not), which this arm calls.
    """
    model = hf_workers.llama(0)
    if arm.get("frozen_embeddings"):
        model.get_input_embeddings().weight.requires_grad_(False)
    kwargs = {"use_reentrant": arm["checkpointing"] == "reentrant"}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23's name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if arm.get("frozen_embeddings"):
        model.enable_input_require_grads()
    model.config.use_cache = False
    return model.train()


def hf_train(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, List[Dict[str, Any]]]:
    """Each arm of ``p["arms"]`` (``checkpointing``, ``frozen_embeddings``, ``recipe``): one epoch of the
    plain loop (epoch_steps) on hf_model, its loss ``model(**batch).loss`` (HF shifts the labels)."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for arm in p["arms"]:
        loader = odb.ODBDataLoader(HFSamples(p), token_budget=p["budget"], sampler=shard(p, rank, world),
                                   buffer_size=p["buffer"], collate_fn=hf_workers.pad_collate, seed=0,
                                   shift_labels=True, gradient_accumulation_steps=2)
        out[arm_name(arm)] = epoch_steps(loader, hf_model(arm), lambda m, b: m(**b).loss, arm["recipe"], False,
                                         p["lr"])
    return out


def hf_reference_grads(p: Dict[str, Any], arm: Dict[str, Any], step: Dict[str, Any]) -> List[torch.Tensor]:
    """Without odb, one process, the same model and checkpointing from the parameters before ``step``: the
    gradient of HF's own loss over one batch of every sample of the step (the mean over their supervised
    shifted tokens; zero where there is none)."""
    ds = HFSamples(p)
    model = hf_model(arm)
    load(model, step["params"])
    batch = hf_workers.pad_collate([ds[i] for i in step["ids"]])
    if not (batch["labels"][:, 1:] != IGNORE).any():
        return [torch.zeros_like(t) for t in trainable(model)]
    model(**batch).loss.backward()
    return clone_all(t.grad for t in trainable(model))
