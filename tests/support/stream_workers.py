"""Distributed workers for tests/data/test_dist_streams.py (run by dist_harness as "stream_workers:<name>").

Streams as people run them under DDP: an IterableDataset that shards its data by rank (uneven
shards, as files of a streaming dataset split by node are) and again by DataLoader worker,
read by num_workers=2 on every rank; and persistent workers over several epochs. Every rank
records each batch it got: the global indices its samples carry, the step info, and the
supervised tokens counted again from the collated labels and from the lengths (independent of
odb's own count).
"""

from __future__ import annotations

import json
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

import odb
from helpers import IGNORE, LengthDataset, known_lengths, make_sample, pad_collate


def supervised(length: int) -> int:
    """Supervised tokens of helpers.make_sample(i, length): every label but those at 1, 4, 7, ..."""
    return length - len(range(1, length, 3))


def shards(sizes: Sequence[int]) -> List[List[int]]:
    """Global indices 0..sum(sizes)-1 in contiguous shards of the given sizes, one per rank."""
    bounds = np.cumsum([0] + list(sizes))
    return [list(range(int(bounds[r]), int(bounds[r + 1]))) for r in range(len(sizes))]


class RankWorkerStream(IterableDataset):
    """This rank's shard of global indices, split again across DataLoader workers (worker w of W
    yields shard[w::W]), as a streaming dataset shards its files by rank and by worker."""

    def __init__(self, lengths: Sequence[int], shard: Sequence[int]) -> None:
        self.lengths, self.shard = list(lengths), list(shard)

    def _mine(self) -> List[int]:
        info = get_worker_info()
        return self.shard[info.id::info.num_workers] if info is not None else self.shard

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        for i in self._mine():
            yield make_sample(i, self.lengths[i])


class StatefulRankWorkerStream(RankWorkerStream):
    """RankWorkerStream with its own state (each worker's position in its share), as
    datasets.IterableDataset offers: odb resumes it from the state instead of replaying it."""

    def __init__(self, lengths: Sequence[int], shard: Sequence[int]) -> None:
        super().__init__(lengths, shard)
        self._start = self._next = 0

    def __iter__(self) -> Iterator[Dict[str, Any]]:
        mine, start, self._start = self._mine(), self._start, 0
        for k in range(start, len(mine)):
            self._next = k + 1
            yield make_sample(mine[k], self.lengths[mine[k]])

    def state_dict(self) -> Dict[str, int]:
        return {"next": self._next}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self._start = self._next = int(state["next"])


def _record(batch: Dict[str, Any], info: odb.ODBStepInfo, lengths: Sequence[int]) -> Dict[str, Any]:
    idx = [int(i) for i in batch["idx"]]
    return {"epoch": info.epoch, "step": info.micro_batch, "ghost": info.is_ghost, "idx": idx,
            "local": info.local_loss_tokens, "global": info.global_loss_tokens, "scale": info.loss_scale,
            "micro": [info.micro_step, info.micro_steps], "world": info.world_size,
            "pids": sorted({int(pid) for pid in batch["pid"]}),  # the processes that read the samples
            "counted": int((batch["labels"] != IGNORE).sum()),  # from the collated batch, not from odb
            "from_lengths": sum(supervised(lengths[i]) for i in idx)}


def _loader(rank: int, world: int, p: Dict[str, Any], **override: Any) -> odb.ODBDataLoader:
    options: Dict[str, Any] = dict(token_budget=p["budget"], num_workers=2, collate_fn=pad_collate, seed=0,
                                   shift_labels=False, window_budgets=p.get("window_budgets", 4),
                                   gradient_accumulation_steps=p.get("accumulation", 1),
                                   persistent_workers=p.get("persistent", False), exchange_timeout_s=60.0)
    options.update(override)
    lengths = known_lengths(sum(p["sizes"]), 1, 40, seed=5)
    if p.get("map_style"):
        ds = LengthDataset(lengths)
        return odb.ODBDataLoader(ds, sampler=odb.ShardSampler(ds, shuffle=True, seed=1), **options)
    stream = StatefulRankWorkerStream if p.get("stateful") else RankWorkerStream
    return odb.ODBDataLoader(stream(lengths, shards(p["sizes"])[rank]), **options)


def _epoch(loader: odb.ODBDataLoader, epoch: int, lengths: Sequence[int], limit: Optional[int] = None,
           resumed: bool = False) -> tuple:
    """(records, state after them) of one epoch, or of its first ``limit`` batches."""
    if not resumed:
        loader.set_epoch(epoch)
    out = []
    it = iter(loader)
    for batch in it:
        out.append(_record(batch, odb.pop_step_info(batch), lengths))
        if limit is not None and len(out) == limit:
            break
    state = json.loads(json.dumps(loader.state_dict())) if limit is not None else None
    it.close()  # as a training loop that returns does: every rank stops at the same step
    return out, state


def epochs_and_resume(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """p["epochs"] uninterrupted epochs of one loader; then the same run interrupted after p["stop"]
    batches of epoch p["stop_epoch"], its state saved (JSON) on every rank, and a fresh loader that loads
    it and runs to the end. With p["refusals"], the resumes that are refused by design, with their words."""
    lengths = known_lengths(sum(p["sizes"]), 1, 40, seed=5)
    start = time.monotonic()
    loader = _loader(rank, world, p)
    reference = [_epoch(loader, e, lengths)[0] for e in range(p["epochs"])]
    first = _loader(rank, world, p)
    interrupted = [_epoch(first, e, lengths)[0] for e in range(p["stop_epoch"])]
    head, state = _epoch(first, p["stop_epoch"], lengths, limit=p["stop"])
    dist.barrier()  # every rank saved at the same step: its checkpoint is complete
    second = _loader(rank, world, p)
    second.load_state_dict(state)
    rest, _ = _epoch(second, p["stop_epoch"], lengths, resumed=True)
    later = [_epoch(second, e, lengths)[0] for e in range(p["stop_epoch"] + 1, p["epochs"])]
    out: Dict[str, Any] = {"reference": reference, "before": interrupted, "head": head, "rest": rest,
                           "later": later, "elapsed": time.monotonic() - start, "arrived": state["run"]["position"]["arrived"]}
    if p.get("refusals"):
        out["refusals"] = _refusals(rank, world, p, state)
    return out


def _refusals(rank: int, world: int, p: Dict[str, Any], state: Dict[str, Any]) -> Dict[str, str]:
    """What load_state_dict says to the resumes of a stream that docs/resume.md refuses (no collective
    runs: each is refused before iteration)."""
    said = {}
    try:
        _loader(rank, world, p, num_workers=1).load_state_dict(state)
        said["num_workers"] = "accepted"
    except ValueError as err:
        said["num_workers"] = str(err)
    states: List[Any] = [None] * world
    dist.all_gather_object(states, state)
    try:  # every rank's state into one process: the stream would be re-partitioned over 1 rank
        _loader(rank, world, p, distributed=False).load_state_dict(states)
        said["repartition"] = "accepted"
    except ValueError as err:
        said["repartition"] = str(err)
    return said


def epochs_resumed_in_place(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """The interrupted run's own loader (its persistent workers still alive) loads the state saved in
    the middle of epoch p["stop_epoch"] and runs that epoch's rest and the epochs after it again."""
    lengths = known_lengths(sum(p["sizes"]), 1, 40, seed=5)
    loader = _loader(rank, world, p)
    reference = [_epoch(loader, e, lengths)[0] for e in range(p["epochs"])]
    first = _loader(rank, world, p)
    for e in range(p["stop_epoch"]):
        _epoch(first, e, lengths)
    head, state = _epoch(first, p["stop_epoch"], lengths, limit=p["stop"])
    for e in range(p["stop_epoch"], p["epochs"]):  # the run goes on past the checkpoint ...
        _epoch(first, e, lengths)
    first.load_state_dict(state)  # ... then rewinds to it, in the same loader
    rest, _ = _epoch(first, p["stop_epoch"], lengths, resumed=True)
    later = [_epoch(first, e, lengths)[0] for e in range(p["stop_epoch"] + 1, p["epochs"])]
    return {"reference": reference, "head": head, "rest": rest, "later": later}
