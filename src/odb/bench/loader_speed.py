"""Loader speed: a plain DataLoader against ODBDataLoader over the same cheap dataset, in one run.

The dataset only creates tensors (``torch.randint`` of each sample's length), so the
figures show what the loaders themselves cost: inter-process transfer, planning and
collation. CPU time counts every process: the main one (``RUSAGE_SELF``) plus the
workers, which ``RUSAGE_CHILDREN`` counts once they have exited and been reaped
(the loaders here do not keep persistent workers, so they exit at the end of the epoch).
"""

from __future__ import annotations

import gc
import resource
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..loader import ODBDataLoader

PAD_ID = 0
GOALS = {"samples_per_s_ratio_min": 0.8, "cpu_s_ratio_max": 1.25, "first_batch_extra_s_max": 0.3}


class LengthDataset(Dataset):
    """Sample i is ``{"input_ids": randint(1, vocab, (lengths[i],))}``: tensor creation only."""

    def __init__(self, lengths: Sequence[int], vocab: int = 1000) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1, self.vocab, (int(self.lengths[index]),))}


def pad_collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Right-pad input_ids; attention_mask marks real tokens; labels are -100 on padding."""
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True,
                                          padding_value=PAD_ID)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _cpu_s(self0: Any, child0: Any) -> float:
    self1, child1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return ((self1.ru_utime - self0.ru_utime) + (self1.ru_stime - self0.ru_stime)
            + (child1.ru_utime - child0.ru_utime) + (child1.ru_stime - child0.ru_stime))


def measure_epoch(make_loader: Callable[[], DataLoader], series: Optional[Dict[str, List[float]]] = None
                  ) -> Dict[str, float]:
    """One epoch: samples/s, CPU seconds of all processes, seconds to the first batch.

    With ``series``, an odb loader's per-step metrics (ODBStepInfo) are appended to it.
    """
    loader = make_loader()
    gc.collect()
    self0, child0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    first = None
    samples = 0
    it = iter(loader)
    for batch in it:
        if first is None:
            first = time.perf_counter() - t0
        samples += int(batch["input_ids"].shape[0])
        if series is not None and "odb_step_info" in batch:
            info = batch["odb_step_info"]
            for key, value in (("batch_size", info.local_samples), ("padding_ratio", info.padding_ratio),
                               ("buffered_samples", info.buffered_samples), ("loader_wait_ms", info.loader_wait_s * 1e3),
                               ("padded_tokens", info.padded_tokens)):
                series.setdefault(key, []).append(float(value))
    wall = time.perf_counter() - t0
    del it, loader  # workers are joined (and reaped) when the epoch ends; make sure before reading rusage
    gc.collect()
    return {"samples": samples, "wall_s": wall, "samples_per_s": samples / wall, "cpu_s": _cpu_s(self0, child0),
            "first_batch_s": float(first or 0.0)}


def loaders(dataset: Dataset, num_workers: int, budget: int, batch_size: int,
            bs1_dataset: Dataset) -> Dict[str, Callable[[], DataLoader]]:
    return {
        f"plain_bs{batch_size}": lambda: DataLoader(dataset, batch_size=batch_size, shuffle=True,
                                                    collate_fn=pad_collate, num_workers=num_workers),
        "odb": lambda: ODBDataLoader(dataset, token_budget=budget, shuffle=True, seed=0, collate_fn=pad_collate,
                                     num_workers=num_workers),
        "plain_bs1": lambda: DataLoader(bs1_dataset, batch_size=1, shuffle=True, collate_fn=pad_collate,
                                        num_workers=num_workers),
    }


def run_loader_speed(lengths: Sequence[int], *, num_workers: int = 2, budget: int = 16384, batch_size: int = 16,
                     repeats: int = 3, bs1_samples: int = 4000, warm_up_samples: int = 512,
                     progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Each loader once per repeat, the order alternating between repeats; medians reported.

    ``DataLoader(batch_size=1)`` moves one message per sample and is slow, so it reads
    only the first ``bs1_samples`` samples (its samples/s is a per-sample rate either way).
    Every loader first runs one untimed epoch over ``warm_up_samples`` samples.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    dataset = LengthDataset(lengths)
    makers = loaders(dataset, num_workers, budget, batch_size, LengthDataset(lengths[:bs1_samples]))
    names = list(makers)
    small = LengthDataset(lengths[:warm_up_samples])
    for make in loaders(small, num_workers, budget, batch_size, small).values():
        measure_epoch(make)
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in names}
    schedule = [(r, name) for r in range(repeats) for name in (names if r % 2 == 0 else names[::-1])]
    series: Dict[str, List[float]] = {}
    for _, name in progress(schedule, desc="loader speed", unit="epoch"):
        if name == "odb":
            series = {}  # keep the last odb epoch's per-step metrics
        runs[name].append(measure_epoch(makers[name], series if name == "odb" else None))
    med = {name: {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]} for name in names}
    base, odb, one = med[f"plain_bs{batch_size}"], med["odb"], med["plain_bs1"]
    ratios = {
        "samples_per_s_ratio": odb["samples_per_s"] / base["samples_per_s"],
        "cpu_s_ratio": odb["cpu_s"] / base["cpu_s"],
        "first_batch_extra_s": odb["first_batch_s"] - base["first_batch_s"],
        "loader_throughput_ratio": odb["samples_per_s"] / one["samples_per_s"],
    }
    goals_met = {
        "samples_per_s_ratio": ratios["samples_per_s_ratio"] >= GOALS["samples_per_s_ratio_min"],
        "cpu_s_ratio": ratios["cpu_s_ratio"] <= GOALS["cpu_s_ratio_max"],
        "first_batch_extra_s": ratios["first_batch_extra_s"] <= GOALS["first_batch_extra_s_max"],
    }
    return {"samples": len(dataset), "bs1_samples": min(bs1_samples, len(dataset)), "num_workers": num_workers, "token_budget": budget, "batch_size": batch_size,
            "repeats": repeats, "median": med, "runs": runs, "ratios": ratios, "goals": GOALS,
            "goals_met": goals_met, "odb_step_metrics": series}
