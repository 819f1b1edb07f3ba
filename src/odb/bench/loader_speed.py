"""Loader cost: ODBDataLoader against a plain DataLoader that yields exactly odb's batches.

The dataset is nearly free (item i is a tensor built once, before the epoch: reading it
is an index) and the collate is written in Python (a loop over the samples that fills
padded tensors row by row), so what is measured is the loaders' own work: transfer
between processes, planning and collation.

The baseline is a plain ``DataLoader`` whose ``batch_sampler`` replays odb's planned
batches (``ReplayBatches``: the sample indices of every batch of one recorded odb epoch),
so both loaders pad the same tokens and collate the same batches: no padding hides a
cost. It collates in its workers, odb in the main process (odb must see the samples to
plan them). Two settings, each with its own recording: odb at its defaults, and at
``buffer_size=256`` (windows of 256 samples, as users of the earlier
``online-dynamic-batching`` package set it).

Figures per loader: samples/s, CPU seconds of all processes, time to the first batch,
and the training thread's CPU per sample: ``time.thread_time()`` of the thread that
iterates the loader, summed over its ``next()`` calls (the CPU the loader takes from
the thread that drives the model). CPU seconds of all processes count the main one
(``RUSAGE_SELF``, every thread) plus the workers, which ``RUSAGE_CHILDREN`` counts once
they have exited and been reaped (no persistent workers here, so they exit at the end
of the epoch).
"""

from __future__ import annotations

import gc
import resource
import warnings
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import odb
from odb.loader.batch_checks import ShiftLabelsWarning

PAD_ID = 0
GOALS = {"samples_per_s_ratio_min": 0.9, "cpu_s_ratio_max": 1.25, "first_batch_extra_s_max": 0.3}
DESCRIPTION = ("nearly free dataset (items built before the epoch), Python collate (row-by-row loop); baseline: a "
               "plain DataLoader replaying odb's batches (batch_sampler), collating in its workers")


class LengthDataset(Dataset):
    """Sample i is ``{"input_ids": randint(1, vocab, (lengths[i],))}``: tensor creation only."""

    def __init__(self, lengths: Sequence[int], vocab: int = 1000) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.vocab = vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(1, self.vocab, (int(self.lengths[index]),))}


class FreeDataset(Dataset):
    """Sample i is ``{"input_ids": <a tensor of lengths[i] tokens built in __init__>}``: reading is an index.

    Each tensor has its own storage (a view into one big tensor would ship the whole
    storage to the main process).
    """

    def __init__(self, lengths: Sequence[int], vocab: int = 1000, seed: int = 0) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        g = torch.Generator().manual_seed(seed)
        pool = torch.randint(1, vocab, (int(self.lengths.max()) + 4096,), generator=g)
        offsets = np.random.default_rng(seed).integers(0, 4096, size=len(self.lengths))
        self.items = [pool[o:o + n].clone() for o, n in zip(offsets.tolist(), self.lengths.tolist())]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.items[index]}


def pad_collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """Right-pad input_ids; attention_mask marks real tokens; labels are -100 on padding."""
    ids = torch.nn.utils.rnn.pad_sequence([s["input_ids"] for s in samples], batch_first=True,
                                          padding_value=PAD_ID)
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    mask = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def python_collate(samples: List[Dict[str, torch.Tensor]]) -> Dict[str, torch.Tensor]:
    """The same batch as ``pad_collate``, filled by a Python loop over the samples."""
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.full((len(samples), width), PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    labels = torch.full((len(samples), width), -100, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n] = s["input_ids"]
        mask[row, :n] = 1
        labels[row, :n] = s["input_ids"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}



def _cpu_s(self0: Any, child0: Any) -> float:
    self1, child1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return ((self1.ru_utime - self0.ru_utime) + (self1.ru_stime - self0.ru_stime)
            + (child1.ru_utime - child0.ru_utime) + (child1.ru_stime - child0.ru_stime))


def measure_epoch(make_loader: Callable[[], DataLoader], series: Optional[Dict[str, List[float]]] = None
                  ) -> Dict[str, float]:
    """One epoch: samples/s, CPU seconds of all processes, training-thread CPU, seconds to the first batch.

    With ``series``, an odb loader's per-step metrics (ODBStepInfo) are appended to it.
    """
    # The collate's labels repeat input_ids (a causal LM's) and no model shifts them here: odb's advice to
    # pass shift_labels=True concerns the loss, which this loader-only measurement has none of.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShiftLabelsWarning)
        return _timed_epoch(make_loader, series)


def _timed_epoch(make_loader: Callable[[], DataLoader], series: Optional[Dict[str, List[float]]]) -> Dict[str, float]:
    loader = make_loader()
    gc.collect()
    self0, child0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    first = None
    samples = 0
    thread_cpu = 0.0
    it = iter(loader)
    while True:
        c0 = time.thread_time()
        batch = next(it, None)
        thread_cpu += time.thread_time() - c0
        if batch is None:
            break
        if first is None:
            first = time.perf_counter() - t0
        samples += int(batch["input_ids"].shape[0])
        info = odb.pop_step_info(batch) if "odb_step_info" in batch else None  # as a training loop does
        if series is not None and info is not None:
            for key, value in (("batch_size", info.local_samples), ("padding_ratio", info.padding_ratio),
                               ("buffered_samples", info.buffered_samples), ("loader_wait_ms", info.loader_wait_s * 1e3),
                               ("padded_tokens", info.padded_tokens)):
                series.setdefault(key, []).append(float(value))
    wall = time.perf_counter() - t0
    del it, loader  # workers are joined (and reaped) when the epoch ends; make sure before reading rusage
    gc.collect()
    return {"samples": samples, "wall_s": wall, "samples_per_s": samples / wall, "cpu_s": _cpu_s(self0, child0),
            "thread_cpu_s": thread_cpu, "thread_cpu_us_per_sample": 1e6 * thread_cpu / max(samples, 1),
            "first_batch_s": float(first or 0.0)}


class ReplayBatches:
    """A ``batch_sampler`` that yields the given index lists, in order, every epoch.

    Example:
        >>> list(ReplayBatches([[3, 1], [0, 2]]))
        [[3, 1], [0, 2]]
    """

    def __init__(self, batches: Sequence[Sequence[int]]) -> None:
        self.batches = [list(map(int, b)) for b in batches]

    def __iter__(self) -> Any:
        return iter([list(b) for b in self.batches])

    def __len__(self) -> int:
        return len(self.batches)


def record_batches(loader: Any) -> List[List[int]]:
    """The dataset indices of every batch of one epoch of an odb loader (its ``ODBStepInfo.sample_ids``)."""
    with warnings.catch_warnings():  # see measure_epoch
        warnings.simplefilter("ignore", ShiftLabelsWarning)
        return [list(odb.pop_step_info(batch).sample_ids) for batch in loader]


SETTINGS = {"defaults": {}, "buffer_size=256": {"buffer_size": 256}}


def loaders(dataset: Dataset, num_workers: int, budget: int, collate: Callable[[List[Any]], Any],
            options: Dict[str, Any], batches: Sequence[Sequence[int]]) -> Dict[str, Callable[[], DataLoader]]:
    return {
        "odb": lambda: odb.ODBDataLoader(dataset, token_budget=budget, shuffle=True, seed=0, collate_fn=collate,
                                         num_workers=num_workers, **options),
        "plain_replay": lambda: DataLoader(dataset, batch_sampler=ReplayBatches(batches), collate_fn=collate,
                                           num_workers=num_workers),
    }


def run_setting(setting: str, lengths: Sequence[int], *, num_workers: int = 2, budget: int = 16384,
                repeats: int = 3, warm_up_samples: int = 512,
                progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """odb (with the setting's options) and the plain replay of its batches, once per repeat, the order
    alternating between repeats; medians reported. Both first run one untimed epoch over
    ``warm_up_samples`` samples."""
    lengths = np.asarray(lengths, dtype=np.int64)
    options = SETTINGS[setting]
    dataset = FreeDataset(lengths)
    make_odb = lambda ds: odb.ODBDataLoader(ds, token_budget=budget, shuffle=True, seed=0,  # noqa: E731
                                             collate_fn=python_collate, num_workers=num_workers, **options)
    batches = record_batches(make_odb(dataset))  # the same seed: the timed odb epochs plan these batches
    small = FreeDataset(lengths[:warm_up_samples])
    for make in loaders(small, num_workers, budget, python_collate, options, record_batches(make_odb(small))).values():
        measure_epoch(make)
    makers = loaders(dataset, num_workers, budget, python_collate, options, batches)
    names = list(makers)
    runs: Dict[str, List[Dict[str, float]]] = {name: [] for name in names}
    schedule = [(r, name) for r in range(repeats) for name in (names if r % 2 == 0 else names[::-1])]
    series: Dict[str, List[float]] = {}
    for _, name in progress(schedule, desc=f"loader speed, {setting}", unit="epoch"):
        if name == "odb":
            series = {}  # keep the last odb epoch's per-step metrics
        runs[name].append(measure_epoch(makers[name], series if name == "odb" else None))
    med = {name: {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]} for name in names}
    base, o = med["plain_replay"], med["odb"]
    ratios = {
        "samples_per_s_ratio": o["samples_per_s"] / base["samples_per_s"],
        "cpu_s_ratio": o["cpu_s"] / base["cpu_s"],
        "first_batch_extra_s": o["first_batch_s"] - base["first_batch_s"],
        "thread_cpu_ratio": o["thread_cpu_us_per_sample"] / max(base["thread_cpu_us_per_sample"], 1e-9),
    }
    goals_met = {
        "samples_per_s_ratio": ratios["samples_per_s_ratio"] >= GOALS["samples_per_s_ratio_min"],
        "cpu_s_ratio": ratios["cpu_s_ratio"] <= GOALS["cpu_s_ratio_max"],
        "first_batch_extra_s": ratios["first_batch_extra_s"] <= GOALS["first_batch_extra_s_max"],
    }
    return {"setting": setting, "odb_options": options, "description": DESCRIPTION, "collate": "python_collate",
            "samples": len(dataset), "batches": len(batches), "mean_batch_size": len(dataset) / len(batches),
            "num_workers": num_workers, "token_budget": budget, "repeats": repeats, "median": med, "runs": runs,
            "ratios": ratios, "goals": GOALS, "goals_met": goals_met, "odb_step_metrics": series}


def run_loader_speed(lengths: Sequence[int], *, settings: Sequence[str] = tuple(SETTINGS), **kwargs: Any
                     ) -> Dict[str, Any]:
    """Every setting over the same lengths; see ``run_setting`` for the arguments."""
    out = {name: run_setting(name, lengths, **kwargs) for name in settings}
    first = next(iter(out.values()))
    lengths = np.asarray(lengths)
    return {"regimes": out, "samples": first["samples"], "num_workers": first["num_workers"],
            "token_budget": first["token_budget"], "repeats": first["repeats"],
            "lengths": {"mean": float(lengths.mean()), "cv": float(lengths.std() / lengths.mean())}}
