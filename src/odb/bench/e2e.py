"""End to end: a training loop over a dataset that costs CPU per sample, odb against fixed batching.

The dataset stands in for tokenization: reading sample i keeps the worker busy for
``base + per_token x length_i`` seconds of its own CPU time (a spin on
``time.thread_time()``, so the CPU cost of every sample is fixed whatever else runs),
then returns ``{"input_ids": randint(length_i)}``. The training "step" stands in for
waiting on a GPU: it sleeps ``c x B x L`` seconds (B x L = the batch's padded tokens),
which releases the GIL. Two settings share the dataset and differ in ``c``:

- compute-bound: the steps of a padding-free plan would take ``COMPUTE_RATIO`` x the data time;
- data-bound: they would take ``DATA_RATIO`` x the data time.

Data time = the CPU time that reading every sample costs, measured by calling
``dataset[i]`` for every i in this process and summing ``time.thread_time()``,
divided by the number of workers: what the workers need at the least, with perfect
parallelism and nothing else running. An arm's own data time is its loader's epoch with
a step that costs nothing (the same loader, shuffle and workers, median of repeats): the
data time plus what that loader adds (its main-process work, which shares the cores
with the workers, and its worker overhead). Compute time = the sum of the measured step
sleeps of an arm. End-to-end overlap = epoch time / max(the arm's own data time, compute
time): 1.0 means the loader hid all the work behind the slower side; the overlap against
the nominal data time is reported beside it. Beside them: the CPU
seconds of the main process (every thread) and of the workers during the epoch, which
show where the CPU went, and their sum over the machine's cores: no schedule can finish
the epoch sooner than that (the CPU floor).

Arms, in the same run, the order alternating between repeats: ``odb``
(``ODBDataLoader(token_budget=...)``), ``plain-fit`` (``DataLoader(batch_size=B)``
with the largest B whose worst case fits the budget: budget // longest sample) and
``plain-mean`` (B = odb's mean batch size, rounded; such batches may exceed the budget).
Same workers, same collate, same shuffle.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time
from typing import Any, Callable, Dict, List, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import odb
from odb.window import plan_stream

from .loader_speed import pad_collate
from .workloads import lognormal_lengths

COMPUTE_RATIO = 1.6  # compute-bound: padding-free compute / data time
DATA_RATIO = 0.25  # data-bound
GOALS = {"overlap_max": 1.2, "data_bound_slowdown_max": 1.03}


class BusyDataset(Dataset):
    """Sample i costs ``base_s + per_token_s x length_i`` of CPU time in whoever reads it."""

    def __init__(self, lengths: Sequence[int], base_s: float = 2e-4, per_token_s: float = 3e-6,
                 vocab: int = 1000) -> None:
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.base_s, self.per_token_s, self.vocab = base_s, per_token_s, vocab

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        n = int(self.lengths[index])
        end = time.thread_time() + self.base_s + self.per_token_s * n
        spins = 0
        while time.thread_time() < end:  # busy work, a stand-in for tokenization
            spins += 1
        return {"input_ids": torch.randint(1, self.vocab, (n,))}


def data_cpu_s(dataset: Dataset) -> float:
    """CPU seconds that reading every sample once costs, measured in this process."""
    t0 = time.thread_time()
    for i in range(len(dataset)):
        dataset[i]
    return time.thread_time() - t0


def run_epoch(loader: DataLoader, c: float, budget: int, is_odb: bool) -> Dict[str, float]:
    """One epoch of the loop: wait for a batch, then 'train' on it for c x padded tokens seconds."""
    gc.collect()
    self0, child0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    wait = wait_cpu = compute = 0.0
    steps = samples = real = padded = over = 0
    max_b = 0
    t0 = time.perf_counter()
    it = iter(loader)
    first = None
    first_wait = 0.0
    while True:
        a, a_cpu = time.perf_counter(), time.thread_time()
        batch = next(it, None)
        waited = time.perf_counter() - a
        wait += waited
        wait_cpu += time.thread_time() - a_cpu
        if batch is None:
            break
        if first is None:
            first, first_wait = time.perf_counter() - t0, waited
        if is_odb:
            odb.pop_step_info(batch)
        b, length = batch["input_ids"].shape
        cost = int(b * length)
        a = time.perf_counter()
        time.sleep(c * cost)  # the step: releases the GIL, as waiting on a GPU does
        compute += time.perf_counter() - a
        steps += 1
        samples += int(b)
        real += int(batch["attention_mask"].sum())
        padded += cost
        over += cost > budget
        max_b = max(max_b, int(b))
    epoch = time.perf_counter() - t0
    del it, loader  # the workers exit (and are reaped) before the CPU time is read
    gc.collect()
    self1, child1 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    main_cpu = (self1.ru_utime - self0.ru_utime) + (self1.ru_stime - self0.ru_stime)
    workers_cpu = (child1.ru_utime - child0.ru_utime) + (child1.ru_stime - child0.ru_stime)
    return {"epoch_s": epoch, "loader_wait_s": wait, "wait_after_first_s": wait - first_wait,
            "loader_cpu_s": wait_cpu, "compute_s": compute, "main_cpu_s": main_cpu, "workers_cpu_s": workers_cpu,
            "first_batch_s": float(first or 0.0), "steps": steps, "samples": samples, "real_tokens": real,
            "padded_tokens": padded, "over_budget_batches": over, "max_batch_size": max_b}


def make_loaders(dataset: Dataset, budget: int, fit_b: int, mean_b: int, num_workers: int,
                 seed: int) -> Dict[str, Callable[[], DataLoader]]:
    def plain(b: int) -> Callable[[], DataLoader]:
        return lambda: DataLoader(dataset, batch_size=b, shuffle=True, collate_fn=pad_collate,
                                  num_workers=num_workers, generator=torch.Generator().manual_seed(seed))

    return {
        "odb": lambda: odb.ODBDataLoader(dataset, token_budget=budget, shuffle=True, seed=seed,
                                         collate_fn=pad_collate, num_workers=num_workers),
        "plain-fit": plain(fit_b),
        "plain-mean": plain(mean_b),
    }


def loader_only_s(dataset: Dataset, budget: int, fit_b: int, mean_b: int, num_workers: int, repeats: int,
                  progress: Callable[..., Any]) -> Dict[str, float]:
    """Each arm's own data time: the median epoch of its loader with a step that costs nothing."""
    makers = make_loaders(dataset, budget, fit_b, mean_b, num_workers, seed=0)
    names = list(makers)
    runs: Dict[str, List[float]] = {k: [] for k in names}
    schedule = [(r, k) for r in range(repeats) for k in (names if r % 2 == 0 else names[::-1])]
    for _, k in progress(schedule, desc="end to end, loader alone", unit="epoch"):
        runs[k].append(run_epoch(makers[k](), 0.0, budget, k == "odb")["epoch_s"])
    return {k: statistics.median(v) for k, v in runs.items()}


def run_setting(name: str, ratio: float, dataset: Dataset, data_s: float, own_data_s: Dict[str, float],
                budget: int, fit_b: int, mean_b: int, num_workers: int, repeats: int,
                progress: Callable[..., Any]) -> Dict[str, Any]:
    real_total = int(np.asarray(dataset.lengths).sum())
    c = ratio * data_s / real_total  # seconds per padded token
    makers = make_loaders(dataset, budget, fit_b, mean_b, num_workers, seed=0)
    names = list(makers)
    runs: Dict[str, List[Dict[str, float]]] = {k: [] for k in names}
    schedule = [(r, k) for r in range(repeats) for k in (names if r % 2 == 0 else names[::-1])]
    for _, k in progress(schedule, desc=f"end to end, {name}", unit="epoch"):
        runs[k].append(run_epoch(makers[k](), c, budget, k == "odb"))
    med = {k: {f: statistics.median(r[f] for r in runs[k]) for f in runs[k][0]} for k in names}
    cpus = os.cpu_count() or 1
    for k, m in med.items():
        m["data_s"] = data_s
        m["own_data_s"] = own_data_s[k]
        # No schedule beats the CPU the epoch used spread over every core: the floor of a data-bound epoch.
        m["cpu_floor_s"] = (m["main_cpu_s"] + m["workers_cpu_s"]) / cpus
        m["overlap"] = m["epoch_s"] / max(own_data_s[k], m["compute_s"])
        m["overlap_nominal"] = m["epoch_s"] / max(data_s, m["compute_s"])
        m["token_efficiency"] = m["real_tokens"] / m["padded_tokens"]
        m["mean_batch_size"] = m["samples"] / m["steps"]
    o, fit, mean = med["odb"], med["plain-fit"], med["plain-mean"]
    out: Dict[str, Any] = {"ratio": ratio, "seconds_per_padded_token": c, "median": med, "runs": runs,
                           "odb_vs_plain_fit": o["epoch_s"] / fit["epoch_s"],
                           "odb_vs_plain_mean": o["epoch_s"] / mean["epoch_s"]}
    met = {"overlap": o["overlap"] <= GOALS["overlap_max"]}
    if name == "compute-bound":
        met["faster_than_plain_fit"] = o["epoch_s"] < fit["epoch_s"]
        met["faster_than_plain_mean"] = o["epoch_s"] < mean["epoch_s"]
    else:
        met["vs_plain_fit"] = out["odb_vs_plain_fit"] <= GOALS["data_bound_slowdown_max"]
        met["vs_plain_mean"] = out["odb_vs_plain_mean"] <= GOALS["data_bound_slowdown_max"]
    out["goals_met"] = met
    return out


def run_e2e(samples: int, *, num_workers: int = 2, budget: int = 8192, mean_length: float = 600.0,
            cv: float = 1.0, max_len: int = 4096, repeats: int = 3, warm_up_samples: int = 128,
            progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Both settings, every arm ``repeats`` times (order alternating); medians per arm."""
    lengths = lognormal_lengths(mean_length, cv, samples, seed=1, max_len=max_len)
    dataset = BusyDataset(lengths)
    fit_b = max(1, budget // int(lengths.max()))
    planned = [g for w in plan_stream(lengths, odb.ODBConfig(token_budget=budget)) for g in w.groups]
    mean_b = max(1, int(round(len(lengths) / len(planned))))
    data_cpu = data_cpu_s(dataset)
    data_s = data_cpu / num_workers
    small = BusyDataset(lengths[:warm_up_samples])
    for k, make in make_loaders(small, budget, fit_b, mean_b, num_workers, seed=0).items():
        run_epoch(make(), 0.0, budget, k == "odb")  # untimed: first fork, first batch of each kind
    own = loader_only_s(dataset, budget, fit_b, mean_b, num_workers, repeats, progress)
    settings = {}
    for name, ratio in (("compute-bound", COMPUTE_RATIO), ("data-bound", DATA_RATIO)):
        settings[name] = run_setting(name, ratio, dataset, data_s, own, budget, fit_b, mean_b, num_workers,
                                     repeats, progress)
    return {
        "samples": samples, "num_workers": num_workers, "token_budget": budget, "repeats": repeats,
        "logical_cpus": os.cpu_count(),
        "lengths": {"mean": float(lengths.mean()), "cv": float(lengths.std() / lengths.mean()),
                    "max": int(lengths.max()), "clip": [16, max_len]},
        "sample_cost": {"base_ms": dataset.base_s * 1e3, "per_token_us": dataset.per_token_s * 1e6,
                        "mean_ms": 1e3 * data_cpu / samples},
        "data_cpu_s": data_cpu, "data_s": data_s, "own_data_s": own, "plain_fit_batch_size": fit_b, "plain_mean_batch_size": mean_b,
        "goals": GOALS, "settings": settings,
    }
