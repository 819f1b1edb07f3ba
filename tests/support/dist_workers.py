"""Worker functions run on every rank by dist_harness.run_ranks (one process per rank).

Each takes (rank, world, params) after the gloo default group is up and returns plain
values (lists, dicts, tensors) that the parent test checks. Datasets and models are
module-level so that DataLoader workers and the parent can rebuild them; samples and
the pad collate come from helpers.py (labels: every third token from the second on
unsupervised, so every sample has supervised tokens).
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Dict, List, Sequence

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, IterableDataset, get_worker_info

import odb
from helpers import IGNORE, LengthDataset, known_lengths, make_sample, pad_collate
from odb.comm.protocol import ODBExchangeError

VOCAB = 50  # helpers.make_sample draws ids below 50


class RankStream(IterableDataset):
    """Yields the global indices ``shard`` (this rank's share), split across DataLoader workers."""

    def __init__(self, lengths: Sequence[int], shard: Sequence[int]) -> None:
        self.lengths = list(lengths)
        self.shard = list(shard)

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in self.shard[start::step]:
            yield make_sample(i, self.lengths[i])


def record(batch: Dict[str, Any], info: odb.ODBStepInfo) -> Dict[str, Any]:
    return {"step": info.micro_batch, "local": info.local_samples, "all": info.all_samples_this_step,
            "ghost": info.is_ghost, "scale": info.loss_scale, "ids": list(info.sample_ids), "idx": list(batch["idx"]),
            "padded": info.padded_tokens, "micro": (info.micro_step, info.micro_steps)}


# ---- 1 and 6: DistributedSampler, workers, epochs ------------------------------------------


def exactly_once(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    ds = LengthDataset(known_lengths(p["n"], 1, 60, seed=1))
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=p["seed"], drop_last=False)
    loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=sampler, num_workers=p["num_workers"],
                               persistent_workers=p["persistent"], collate_fn=pad_collate,
                               buffer_size=p["buffer"], seed=p["seed"])
    epochs = []
    for epoch in range(p["epochs"]):
        loader.set_epoch(epoch)
        expected = list(sampler)
        steps, pids = [], set()
        for batch in loader:
            info = odb.pop_step_info(batch)
            steps.append(record(batch, info))
            pids.update(batch["pid"])
        epochs.append({"expected": expected, "steps": steps, "pids": sorted(pids - {os.getpid()})})
    return {"epochs": epochs, "main_pid": os.getpid()}


# ---- 2 and 3: uneven IterableDataset shards, ghosts or Join ---------------------------------


def uneven_shards(p: Dict[str, Any], world: int) -> List[List[int]]:
    """Rank 0 gets ``big`` samples, every other rank ``small``; global indices."""
    sizes = [p["big"]] + [p["small"]] * (world - 1)
    bounds = np.cumsum([0] + sizes)
    return [list(range(int(bounds[r]), int(bounds[r + 1]))) for r in range(world)]


def tiny_linear_loss(model: torch.nn.Module, batch: Dict[str, Any], scale: float) -> torch.Tensor:
    x = torch.nn.functional.one_hot(batch["input_ids"] % 4, 4).float()
    mask = (batch["labels"] != IGNORE).float()
    out = model(x).squeeze(-1)
    return ((out - 1.0) ** 2 * mask).sum() / mask.sum().clamp(min=1) * scale


def uneven_training(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """DDP(Linear) over an uneven IterableDataset; join=True runs plainly, join=False inside Join."""
    n = p["big"] + p["small"] * (world - 1)
    lengths = known_lengths(n, 1, 40, seed=2)
    shard = uneven_shards(p, world)[rank]
    loader = odb.ODBDataLoader(RankStream(lengths, shard), token_budget=p["budget"], buffer_size=p["buffer"],
                               collate_fn=pad_collate, join=p["join"], seed=0, num_workers=p["num_workers"])
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = []
    if p["join"]:
        context = contextlib.nullcontext()
    else:
        from torch.distributed.algorithms import Join

        context = Join([model])
    start = time.monotonic()
    with context:
        for batch in loader:
            info = odb.pop_step_info(batch)
            steps.append(record(batch, info))
            opt.zero_grad()
            tiny_linear_loss(model, batch, info.loss_scale).backward()
            opt.step()
    return {"steps": steps, "elapsed": time.monotonic() - start, "shard": shard,
            "weights": [t.detach().clone() for t in model.parameters()]}


# ---- 4: gradient exactness ----------------------------------------------------------------


def grad_shards(world: int, p: Dict[str, Any]) -> List[List[int]]:
    """Indices of each rank: rank 0 only long samples, rank 1 only short (and few), rank 2 medium."""
    bounds = np.cumsum([0] + p["counts"][:world])
    return [list(range(int(bounds[r]), int(bounds[r + 1]))) for r in range(world)]


def grad_lengths(world: int, p: Dict[str, Any]) -> List[int]:
    ranges = [(40, 64), (2, 8), (12, 24)]
    out: List[int] = []
    for r in range(world):
        out += known_lengths(p["counts"][r], *ranges[r], seed=10 + r)
    return out


def lm_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(VOCAB, 8), torch.nn.Linear(8, VOCAB)).double()


def lm_loss(model: torch.nn.Module, batch: Dict[str, Any], reduction: str = "mean") -> torch.Tensor:
    logits = model(batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                             ignore_index=IGNORE, reduction=reduction)


def grad_exact(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Per optimizer step: the DDP-averaged gradient and every rank's sample ids of that step."""
    ds = LengthDataset(grad_lengths(world, p))
    out = {}
    for k in p["accumulation"]:
        loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=grad_shards(world, p)[rank],
                                   buffer_size=p["buffer"], collate_fn=pad_collate, seed=0,
                                   gradient_accumulation_steps=k, loss_scaling=p.get("loss_scaling", "exact"),
                                   lengths=grad_lengths(world, p) if p.get("known") else None,
                                   num_workers=p.get("num_workers", 0))
        model = DDP(lm_model(p["seed"]))
        opt_steps, ids, micro = [], [], []
        for batch in loader:
            info = odb.pop_step_info(batch)
            ids += list(info.sample_ids)
            micro.append(record(batch, info))
            sync = contextlib.nullcontext() if info.is_last_micro_step else model.no_sync()
            with sync:
                (lm_loss(model, batch) * info.loss_scale).backward()
            if info.is_last_micro_step:
                grads = [t.grad.detach().clone() for t in model.parameters()]
                opt_steps.append({"grads": grads, "ids": ids, "micro": micro})
                ids, micro = [], []
                model.zero_grad(set_to_none=False)
        out[k] = opt_steps
    return out


def reference_grads(world: int, p: Dict[str, Any], ids: Sequence[int]) -> List[torch.Tensor]:
    """Gradient of (sum of per-token losses over ``ids``) / (their supervised tokens), one process."""
    lengths = grad_lengths(world, p)
    model = lm_model(p["seed"])
    batch = pad_collate([make_sample(i, lengths[i]) for i in ids])
    total = int((batch["labels"] != IGNORE).sum())
    (lm_loss(model, batch, reduction="sum") / total).backward()
    return [t.grad.detach().clone() for t in model.parameters()]


# ---- 5: a rank dies -----------------------------------------------------------------------


def rank_death(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    ds = LengthDataset(known_lengths(p["n"], 1, 40, seed=3))
    loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=list(range(rank, p["n"], world)),
                               buffer_size=p["buffer"], collate_fn=pad_collate, seed=0,
                               exchange_timeout_s=p["exchange_timeout_s"])
    steps = 0
    start = time.monotonic()
    try:
        for _ in loader:
            steps += 1
            if rank == p["dying_rank"] and steps == p["die_after"]:
                os._exit(1)
    except ODBExchangeError as err:
        return {"error": str(err), "type": type(err).__name__, "steps": steps,
                "elapsed": time.monotonic() - start}
    return {"error": None, "steps": steps, "elapsed": time.monotonic() - start}


def misbehave(rank: int, world: int, p: Dict[str, Any]) -> None:
    """For the harness's own test: rank p["raising"] raises, rank p["rank"] hangs or raises."""
    if rank == p.get("raising"):
        time.sleep(1.0)
        raise ValueError("boom on purpose")
    if rank == p["rank"]:
        if p["how"] == "raise":
            raise ValueError("boom on purpose")
        time.sleep(3600)


# ---- start methods, two loaders at once, ShardSampler -------------------------------------


def two_loaders(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """A train and an eval loader iterated interleaved, with different worker start methods."""
    train_ds = LengthDataset(known_lengths(p["n"], 1, 60, seed=2))
    eval_ds = LengthDataset(known_lengths(p["n_eval"], 1, 60, seed=3))
    train = odb.ODBDataLoader(train_ds, token_budget=p["budget"], sampler=odb.ShardSampler(train_ds, seed=1),
                              num_workers=1, multiprocessing_context=p["train_ctx"], collate_fn=pad_collate,
                              buffer_size=p["buffer"])
    evals = odb.ODBDataLoader(eval_ds, token_budget=p["budget"], sampler=odb.ShardSampler(eval_ds, shuffle=False),
                              num_workers=1, multiprocessing_context=p["eval_ctx"], collate_fn=pad_collate,
                              buffer_size=p["buffer"])
    train_steps, eval_epochs = [], [[]]
    eval_iter = iter(evals)
    for batch in train:
        train_steps.append(record(batch, odb.pop_step_info(batch)))
        try:
            eb = next(eval_iter)
        except StopIteration:
            eval_epochs.append([])
            eval_iter = iter(evals)
            eb = next(eval_iter)
        eval_epochs[-1].append(record(eb, odb.pop_step_info(eb)))
    return {"train": train_steps, "eval": eval_epochs}


# ---- resume under DDP ----------------------------------------------------------------------


def resume_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """An uninterrupted epoch, then the same epoch interrupted after ``stop`` steps and resumed."""
    import itertools
    import json

    ds = LengthDataset(known_lengths(p["n"], 1, 60, seed=6))

    def make():
        return odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=odb.ShardSampler(ds, seed=2),
                                 num_workers=p["num_workers"], collate_fn=pad_collate, buffer_size=p["buffer"],
                                 first_window_size=16, gradient_accumulation_steps=p["accumulation"])

    def steps(batches):
        out = []
        for batch in batches:
            info = odb.pop_step_info(batch)
            out.append([info.micro_batch, list(info.sample_ids), info.loss_scale, info.all_samples_this_step])
        return out

    reference = steps(make())
    results = {}
    for stop in p["stops"]:
        first = make()
        head = steps(itertools.islice(first, stop))
        state = json.loads(json.dumps(first.state_dict()))
        resumed = make()
        resumed.load_state_dict(state)
        results[stop] = head + steps(resumed)
    return {"reference": reference, "resumed": results}
