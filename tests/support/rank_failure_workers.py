"""Rank workers for tests/comm/test_failure_reaches_every_rank.py (run by dist_harness as
"rank_failure_workers:<name>").

The scenario of a user running DDP: every rank iterates an ``ODBDataLoader`` with two DataLoader
workers over a map-style dataset under a ``DistributedSampler``. On rank 1 something fails mid-epoch:
a worker is SIGKILLed (as the kernel's out-of-memory killer does; while the training step runs, or
by the dataset while it reads a sample), the user's collate_fn raises, or the dataset's
``__getitem__`` raises. Rank 1 records its own error, then does what the test asks:

- ``stays``: stays alive holding the loader's iterator and the error (a user's handler that saves a
  checkpoint inside its ``except`` block; HF's Trainer keeps its iterator in a frame of the
  traceback), until rank 0 has finished;
- ``exits``: returns at once (the process saves its result and exits);
- ``killed``: saves its result and is SIGKILLed a second later (a launcher reaping it).

Rank 0 never meets rank 1 at a barrier: it records what it raised and when. exchange_timeout_s is
600 s and the harness's deadline 60 s, so rank 0 can only pass through odb's announcement.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, List

import numpy as np
from torch.utils.data import Dataset, DistributedSampler, get_worker_info

import odb
from dist_harness import save_result
from failure_workers import FailingCollate
from helpers import make_sample, pad_collate

TIMEOUT_S = 600.0
STAY_S = 30.0  # the longest rank 1 stays alive waiting for rank 0's result


class FailingOnRank(Dataset):
    """Item ``bad`` SIGKILLs the DataLoader worker reading it (``cause="killed_reading"``) or raises
    (``cause="getitem"``); every item sleeps ``read_s`` (a pipeline that processes samples)."""

    def __init__(self, lengths: List[int], bad: int, cause: str, read_s: float) -> None:
        self.lengths, self.bad, self.cause, self.read_s = lengths, bad, cause, read_s

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        if index == self.bad and self.cause == "killed_reading" and get_worker_info() is not None:
            os.kill(os.getpid(), signal.SIGKILL)
        if index == self.bad and self.cause == "getitem":
            raise OSError(f"cannot read sample {index} on purpose")
        time.sleep(self.read_s)
        return make_sample(int(index), self.lengths[index])


def _record(err: BaseException, steps: int) -> Dict[str, Any]:
    return {"type": type(err).__name__, "error": str(err), "failed_rank": getattr(err, "rank", None),
            "t": time.time(), "steps": steps}


def worker_fails_on_rank1(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    n, failing, cause = p["n"], 1, p["cause"]
    lengths = np.random.default_rng(3).integers(1, 40, size=n).tolist()
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=0)
    order = list(iter(sampler))
    bad = order[len(order) // 3] if rank == failing and cause != "killed_in_step" else -1
    collate = FailingCollate(bad) if cause == "collate" else pad_collate
    options: Dict[str, Any] = dict(token_budget=256, sampler=sampler, collate_fn=collate, num_workers=2,
                                   persistent_workers=p.get("persistent", False), exchange_timeout_s=TIMEOUT_S,
                                   seed=0)
    if p.get("global_batch_size"):
        options["global_batch_size"] = p["global_batch_size"]
    if p.get("known"):
        options["lengths"] = lengths
    loader = odb.ODBDataLoader(FailingOnRank(lengths, bad, "" if cause == "collate" else cause, p["read_s"]),
                               **options)
    steps, it = 0, iter(loader)
    try:
        for batch in it:
            odb.pop_step_info(batch)
            steps += 1
            if rank == failing and cause == "killed_in_step" and steps == p.get("after", 5):
                os.kill(multiprocessing.active_children()[0].pid, signal.SIGKILL)
            time.sleep(p["step_s"])  # the training step: the training thread is in the user's code
        return {"type": None, "error": None, "failed_rank": None, "t": time.time(), "steps": steps}
    except Exception as err:  # the process stays alive
        out = _record(err, steps)
        if rank != failing or p["then"] == "exits":
            return out
        tmp = Path(p["tmp"])
        if p["then"] == "killed":
            save_result(out, tmp, rank)  # as dist_harness would, before this process is killed
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
        end = time.monotonic() + STAY_S  # "stays": the iterator `it` and the error `err` stay alive meanwhile
        while not (tmp / "rank0.pt").exists() and time.monotonic() < end:
            time.sleep(0.05)
        out["kept"] = (type(it).__name__, type(err).__name__)
        return out
