"""Small shared fixtures for the loader tests: datasets with known lengths and a pad collate.

Everything here is module-level so that it pickles into spawned worker processes.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

import odb

IGNORE = -100
WORKER_TAG: Optional[int] = None  # set in workers by tag_worker


def known_lengths(n: int, low: int = 1, high: int = 40, seed: int = 0) -> List[int]:
    """n reproducible lengths in [low, high]."""
    return np.random.default_rng(seed).integers(low, high + 1, size=n).tolist()


def make_sample(index: int, length: int, vocab: int = 50) -> Dict[str, Any]:
    """A processed sample: input_ids of ``length``; labels with every third token unsupervised."""
    ids = (torch.arange(length, dtype=torch.long) * 7 + index) % vocab
    labels = ids.clone()
    labels[1::3] = IGNORE
    return {"input_ids": ids, "labels": labels, "idx": index, "pid": os.getpid(), "tag": WORKER_TAG}


class LengthDataset(Dataset):
    """Map-style dataset: item i has ``lengths[i]`` tokens and remembers i and the process that built it."""

    def __init__(self, lengths: Sequence[int], extra: Optional[Dict[str, Sequence[Any]]] = None) -> None:
        self.lengths = list(lengths)
        self.extra = extra or {}

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        sample = make_sample(int(index), self.lengths[index])
        sample.update({k: v[index] for k, v in self.extra.items()})
        return sample


class StreamDataset(IterableDataset):
    """Iterable dataset over ``lengths``; with ``shard=True`` each worker yields its own share."""

    def __init__(self, lengths: Sequence[int], shard: bool = True) -> None:
        self.lengths = list(lengths)
        self.shard = shard

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if self.shard and info is not None else (0, 1)
        for i in range(start, len(self.lengths), step):
            yield make_sample(i, self.lengths[i])


class PadCollate:
    """Pads input_ids (0) and labels (-100) to the longest sample, rounded up to ``multiple``."""

    def __init__(self, multiple: int = 1) -> None:
        self.multiple = multiple

    def __call__(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        longest = max(len(s["input_ids"]) for s in samples)
        width = -(-longest // self.multiple) * self.multiple
        ids = torch.zeros(len(samples), width, dtype=torch.long)
        labels = torch.full((len(samples), width), IGNORE, dtype=torch.long)
        for row, s in enumerate(samples):
            ids[row, :len(s["input_ids"])] = s["input_ids"]
            labels[row, :len(s["labels"])] = s["labels"]
        return {"input_ids": ids, "labels": labels, "idx": [s["idx"] for s in samples],
                "pid": [s["pid"] for s in samples], "tag": [s["tag"] for s in samples]}


def pad_collate(samples: List[Dict[str, Any]]) -> Dict[str, Any]:
    return PadCollate()(samples)


def tag_worker(worker_id: int) -> None:
    """A worker_init_fn: samples built afterwards in this worker carry tag 1000 + worker_id."""
    global WORKER_TAG
    WORKER_TAG = 1000 + worker_id


def epoch(loader: Any) -> List[Dict[str, Any]]:
    """One epoch as a list of batches, each with its step info popped into batch["info"]."""
    out = []
    for batch in loader:
        batch["info"] = odb.pop_step_info(batch)
        out.append(batch)
    return out


def ids_of(batches: List[Dict[str, Any]]) -> List[List[int]]:
    """The sample indices of each batch, in emit order."""
    return [list(b["idx"]) for b in batches]


def flat_ids(batches: List[Dict[str, Any]]) -> List[int]:
    return sorted(i for b in batches for i in b["idx"])


def on_threads(ranks: Any, fn: Any, timeout_s: float = 40.0) -> List[Any]:
    """``fn(rank, ranks.exchanges(rank))`` on one thread per rank of ``ranks`` (odb.comm.threads.ThreadRanks);
    every rank's result, or its exception."""
    import threading

    results: List[Any] = [None] * ranks.world_size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(rank, ranks.exchanges(rank))
        except BaseException as err:  # the test reads it
            results[rank] = err

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(ranks.world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 10)
    assert not any(t.is_alive() for t in threads), "a rank thread still runs"
    return results


class Counting:
    """An exchange factory that counts every exchange's gathers (its transport's), in the order they are made."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.counts = inner, []

    def world(self):
        return self.inner.world()

    def processes(self):
        return self.inner.processes()

    def __call__(self, timeout_s: float) -> Any:
        ex = self.inner(timeout_s)
        slot = len(self.counts)
        self.counts.append(0)
        gather = ex.transport.gather

        def counted(message: np.ndarray, where: str) -> np.ndarray:
            self.counts[slot] += 1
            return gather(message, where)

        ex.transport.gather = counted
        return ex
