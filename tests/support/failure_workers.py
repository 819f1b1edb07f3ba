"""Distributed workers for tests/comm/test_rank_failures.py (run by dist_harness as "failure_workers:<name>").

Every rank stays alive after its loader raised (as a notebook or a trainer that catches the
error does): it records the error and the wall-clock time, meets the others at a barrier of
the default group and, when asked, runs one more epoch of a fresh loader. exchange_timeout_s
is large (600 s) and the harness deadline short, so a pass means the ranks learnt of the
failure through odb's exchange, not through a timeout or a dead process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
import traceback
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import odb
from helpers import LengthDataset, known_lengths, make_sample, pad_collate

TIMEOUT_S = 600.0


class FailingCollate:
    """pad_collate that raises for a batch holding dataset index ``bad``."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        if any(s["idx"] == self.bad for s in samples):
            raise KeyError(f"collate cannot handle sample {self.bad} on purpose")
        return pad_collate(samples)


class FailingDataset(Dataset):
    """LengthDataset whose item ``bad`` raises (in the DataLoader worker that reads it)."""

    def __init__(self, lengths: List[int], bad: int) -> None:
        self.lengths, self.bad = lengths, bad

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        if index == self.bad:
            raise OSError(f"cannot read sample {index} on purpose")
        return make_sample(int(index), self.lengths[index])


class KilledWorkerDataset(Dataset):
    """LengthDataset whose item ``bad`` SIGKILLs the DataLoader worker that reads it (as the kernel's
    out-of-memory killer would); never the main process."""

    def __init__(self, lengths: List[int], bad: int) -> None:
        self.lengths, self.bad = lengths, bad

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        if index == self.bad and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        return make_sample(int(index), self.lengths[index])


class KilledWorkerStream(IterableDataset):
    """A stream over ``indices`` (this rank's shard), sharded by worker; the worker that reaches
    ``bad`` SIGKILLs itself."""

    def __init__(self, lengths: List[int], indices: List[int], bad: int) -> None:
        self.lengths, self.indices, self.bad = lengths, indices, bad

    def __iter__(self):
        info = get_worker_info()
        for i in self.indices[info.id::info.num_workers] if info is not None else self.indices:
            if i == self.bad and info is not None:
                os.kill(os.getpid(), signal.SIGKILL)
            yield make_sample(i, self.lengths[i])


def _shard(rank: int, world: int, n: int) -> List[int]:
    return list(range(rank, n, world))


def _bad_index(p: Dict[str, Any], world: int) -> int:
    """A sample of the failing rank's shard two thirds in (a later window, not the first)."""
    shard = _shard(p["failing"], world, p["n"])
    return shard[len(shard) * 2 // 3]


def _loader(rank: int, world: int, p: Dict[str, Any]) -> odb.ODBDataLoader:
    how, failing = p["how"], rank == p["failing"]
    lengths = known_lengths(p["n"], 1, 40, seed=3)
    bad = _bad_index(p, world)
    options: Dict[str, Any] = dict(token_budget=p["budget"], collate_fn=pad_collate, seed=0,
                                   exchange_timeout_s=TIMEOUT_S, ready_batches=p.get("ready_batches", 4))
    sampler: List[int] = _shard(rank, world, p["n"])
    dataset: Dataset = LengthDataset(lengths)
    if how == "oversize":
        lengths[bad] = p["budget"] + 10  # only the failing rank reads it (its shard)
        dataset = LengthDataset(lengths)
    elif how in ("collate", "known_collate") and failing:
        options["collate_fn"] = FailingCollate(bad)
    elif how == "worker" and failing:
        dataset = FailingDataset(lengths, bad)
    elif how == "killed" and failing:
        dataset = KilledWorkerDataset(lengths, bad)
    elif how == "killed_stream":
        dataset = KilledWorkerStream(lengths, sampler, bad if failing else -1)
        sampler = None
    elif how == "ghost" and failing:
        sampler = []  # nothing to build a ghost batch from
    elif how == "mismatch" and failing:
        options[p["option"]] = p["value"]
    if how in ("worker", "known_collate"):
        options["num_workers"] = 1
    if how in ("killed", "killed_stream", "kill_worker"):
        options["num_workers"] = 2
    if how == "known_collate" or p.get("known"):
        options["lengths"] = lengths
    if "window_budgets" in p:
        options["window_budgets"] = p["window_budgets"]
    if "accumulation" in p and "gradient_accumulation_steps" not in options:
        options["gradient_accumulation_steps"] = p["accumulation"]
    if sampler is not None:
        options["sampler"] = sampler
    return odb.ODBDataLoader(dataset, **options)


def _raised_in(err: Optional[BaseException]) -> Optional[str]:
    """The function the error left first on its way out: for an error raised by a signal handler (torch's
    SIGCHLD handler for a dead worker), the function that was running when the signal came."""
    frames = traceback.extract_tb(err.__traceback__) if err is not None else []
    names = [f.name for f in frames if "signal_handling" not in f.filename]
    return names[-1] if names and len(names) < len(frames) else None


def _record(err: Optional[BaseException], steps: int, start: float) -> Dict[str, Any]:
    return {"type": None if err is None else type(err).__name__, "error": None if err is None else str(err),
            "failed_rank": getattr(err, "rank", None), "t": time.time(), "elapsed": time.monotonic() - start,
            "steps": steps, "raised_in": _raised_in(err)}


def one_rank_fails(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Rank p["failing"] fails as p["how"] says (or stops: "break"; or aborts: "abort"); every rank
    records what it raised, then all meet at a barrier and, with p["then_epoch"], run a clean epoch."""
    loader = _loader(rank, world, p)
    steps, start, err = 0, time.monotonic(), None
    try:
        for _ in loader:
            steps += 1
            if rank == p["failing"] and steps == p.get("after", -1):
                if p["how"] == "break":
                    break
                if p["how"] == "kill_worker":  # the out-of-memory killer picks a worker while the step runs
                    os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
                if p["how"] == "abort":  # what odb's HF check does when a collated batch lost its labels
                    error = ValueError("odb counted 17 supervised tokens in the batch but the collated batch "
                                       "holds 0 (labels != -100) on purpose")
                    loader.odb_abort(error)
                    raise error
            time.sleep(p.get("step_s", 0.0))  # a training step: the training thread is in the user's code
    except Exception as caught:  # the process stays alive
        err = caught
    out = _record(err, steps, start)
    dist.barrier()  # the default group is still in step: nobody is left inside a collective of odb's
    if p.get("then_epoch"):
        fresh = odb.ODBDataLoader(LengthDataset(known_lengths(p["n"], 1, 40, seed=3)), token_budget=p["budget"],
                                  sampler=_shard(rank, world, p["n"]), collate_fn=pad_collate, seed=0,
                                  exchange_timeout_s=TIMEOUT_S)
        out["then_ids"] = [i for b in fresh for i in odb.pop_step_info(b).sample_ids]
    return out


# ---- no hidden collectives; local loaders; a re-created default group -----------------------------


def _plain_loader(p: Dict[str, Any], **options: Any) -> odb.ODBDataLoader:
    ds = LengthDataset(known_lengths(p["n"], 1, 60, seed=1))
    return odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=odb.ShardSampler(ds, seed=1),
                             collate_fn=pad_collate, num_workers=p.get("num_workers", 0), **options)


def _ids(loader: odb.ODBDataLoader) -> List[int]:
    return [i for batch in loader for i in odb.pop_step_info(batch).sample_ids]


def rank0_public_methods_then_own_groups(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Rank 0 alone calls every public method but iteration before the first epoch (the usual
    ``if rank == 0: save(...)``); then every rank creates its own gloo group and all-reduces on it
    and on the default group: odb must have run no collective and created no group meanwhile."""
    loader = _plain_loader(p, exchange_timeout_s=TIMEOUT_S)
    if rank == 0:
        state = loader.state_dict()
        steps = len(loader)
        loader.load_state_dict(state)
        loader.set_epoch(0)
        loader.set_token_budget(p["budget"])
        _ = loader.odb_stats, loader.odb_config
    else:
        steps = None
    mine = dist.new_group(backend="gloo")
    probe = torch.full((1,), float(rank + 1))
    dist.all_reduce(probe, group=mine)
    default = torch.ones(1)
    dist.all_reduce(default)
    ids = _ids(loader)
    if rank == 0:
        loader.state_dict()  # after an epoch too
    after = torch.ones(1)
    dist.all_reduce(after, group=mine)
    return {"ids": ids, "probe": float(probe), "default": float(default), "after": float(after), "len": steps}


def local_loader_on_rank0(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Rank 0 iterates a local loader (distributed=False: evaluation on rank 0 only) between two
    epochs of a distributed one; rank 1 never builds it."""
    train = _plain_loader(p, exchange_timeout_s=TIMEOUT_S)
    first = _ids(train)
    local: Optional[Dict[str, Any]] = None
    if rank == 0:
        ds = LengthDataset(known_lengths(p["n_eval"], 1, 60, seed=2))
        evals = odb.ODBDataLoader(ds, token_budget=p["budget"], collate_fn=pad_collate, distributed=False,
                                  exchange_timeout_s=TIMEOUT_S)
        infos = [odb.pop_step_info(b) for b in evals]
        local = {"ids": sorted(i for info in infos for i in info.sample_ids),
                 "world_sizes": sorted({info.world_size for info in infos}), "ghosts": sum(i.is_ghost for i in infos),
                 "state_world": evals.state_dict()["world_size"], "len": len(evals)}
    train.set_epoch(1)
    second = _ids(train)
    return {"first": first, "second": second, "local": local}


def reinit_default_group(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Iterate, destroy the default group, initialise a new one on another port, iterate again
    (the same loader and a new one): no group of the old default group may be reused."""
    import datetime

    loader = _plain_loader(p, exchange_timeout_s=TIMEOUT_S)
    before = _ids(loader)
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{p['port']}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    loader.set_epoch(1)
    again = _ids(loader)
    fresh = _ids(_plain_loader(p, exchange_timeout_s=TIMEOUT_S))
    probe = torch.ones(1)
    dist.all_reduce(probe)
    return {"before": before, "again": again, "fresh": fresh, "probe": float(probe)}


def fingerprints_agree_for_equal_options(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """The options' hashes of this process, to compare across processes (string hashing is salted)."""
    from odb.comm.agreement import agreed_values, fingerprint

    cfg = odb.ODBConfig(token_budget=(64, 32), seed=3, pack_efficiency=0.9)
    return {"fp": np.asarray(fingerprint(agreed_values(cfg, shuffle=True))).tolist()}
