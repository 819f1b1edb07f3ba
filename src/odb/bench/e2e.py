"""End to end: a training loop over a dataset that costs CPU per sample, odb against fixed batching.

The dataset stands in for tokenization: reading sample i keeps the worker busy for
``base + per_token x length_i`` seconds of its own CPU time (a spin on
``time.thread_time()``, so the CPU cost of every sample is fixed whatever else runs),
then returns ``{"input_ids": randint(length_i)}``. The training step costs ``c x B x L``
seconds (B x L = the batch's padded tokens), of one of two kinds:

- ``sleep``: the thread sleeps, which releases the GIL (waiting on a GPU kernel);
- ``gil``: a pure-Python loop of a fixed number of iterations, calibrated in this process
  to last ``c x B x L`` seconds when nothing else runs. It holds the GIL as Python
  dispatch and kernel launches do: when the loader's threads take the GIL, the step
  takes longer, and when they wait for it, the loader falls behind.

Two settings share the dataset and differ in ``c``:

- compute-bound: the steps of a padding-free plan would take ``COMPUTE_RATIO`` x the data time;
- data-bound: they would take ``DATA_RATIO`` x the data time.

Data time = the CPU time that reading every sample costs, measured by calling
``dataset[i]`` for every i in this process and summing ``time.thread_time()``,
divided by the number of workers: what the workers need at the least, with perfect
parallelism and nothing else running. Compute time = the arm's steps at their nominal
cost (``c x`` its padded tokens). The ideal epoch of an arm is max(data time, compute
time): its loader hides all the work behind the slower side at no cost of its own.
Overlap = epoch time / that ideal. Beside it: the CPU seconds of the main process
(every thread) and of the workers during the epoch, and their sum over the machine's
cores (the CPU floor: no schedule finishes the epoch sooner).

Arms, in the same run, the order alternating between repeats: ``odb``
(``ODBDataLoader(token_budget=...)`` at its defaults), ``plain-fit``
(``DataLoader(batch_size=B)`` with the largest B whose worst case fits the budget:
budget // longest sample), ``length-grouped`` (transformers' ``LengthGroupedSampler``
at that B, as ``group_by_length=True`` builds it, where transformers is installed) and
``plain-mean`` (B = odb's mean batch size, rounded; such batches may exceed the budget).
Same workers, same collate, same shuffle seed.
"""

from __future__ import annotations

import gc
import os
import resource
import statistics
import time
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

import odb
from odb.loader.batch_checks import ShiftLabelsWarning
from odb.plan.windows.window import plan_stream

from odb.bench.loader_speed import pad_collate
from odb.bench.workloads import lognormal_lengths

try:  # transformers is a bench extra: the length-grouped arm runs where it is installed
    from transformers.trainer_pt_utils import LengthGroupedSampler
except ImportError:  # pragma: no cover - depends on the environment
    LengthGroupedSampler = None

COMPUTE_RATIO = 1.6  # compute-bound: padding-free compute / data time
DATA_RATIO = 0.25  # data-bound
STEP_KINDS = ("sleep", "gil")
GOALS = {"overlap_max": 1.15, "data_bound_slowdown_max": 1.03}


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


def spin(iterations: int) -> int:
    """A pure-Python loop of ``iterations`` rounds: the GIL-holding training step's work."""
    x = 0
    for i in range(iterations):
        x += i & 7
    return x


class GilStep:
    """A step that holds the GIL for ``seconds`` of work: ``spin`` of a count calibrated in this process.

    Example:
        >>> step = GilStep(rate=1e6)
        >>> step.iterations(0.002)
        2000
    """

    def __init__(self, rate: float = 0.0) -> None:
        self.rate = rate if rate > 0 else self.calibrate()

    @staticmethod
    def calibrate(seconds: float = 0.1, repeats: int = 5) -> float:
        """Loop rounds per second on this thread with nothing else to do (the fastest of ``repeats``)."""
        n, best = 100_000, 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            spin(n)
            elapsed = time.perf_counter() - t0
            best = max(best, n / max(elapsed, 1e-9))
            n = max(int(best * seconds), 1000)
        return best

    def iterations(self, seconds: float) -> int:
        return int(round(self.rate * seconds))

    def __call__(self, seconds: float) -> None:
        spin(self.iterations(seconds))


def data_cpu_s(dataset: Dataset) -> float:
    """CPU seconds that reading every sample once costs, measured in this process."""
    t0 = time.thread_time()
    for i in range(len(dataset)):
        dataset[i]
    return time.thread_time() - t0


def run_epoch(loader: DataLoader, c: float, budget: int, is_odb: bool,
              step: Callable[[float], None] = time.sleep) -> Dict[str, float]:
    """One epoch of the loop: wait for a batch, then ``step(c x padded tokens)``."""
    # The collate's labels repeat input_ids and no model shifts them: odb's advice to pass
    # shift_labels=True concerns a loss, which this stand-in step has none of.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShiftLabelsWarning)
        return _run_epoch(loader, c, budget, is_odb, step)


def _run_epoch(loader: DataLoader, c: float, budget: int, is_odb: bool,
               step: Callable[[float], None]) -> Dict[str, float]:
    gc.collect()
    self0, child0 = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    wait = wait_cpu = step_s = 0.0
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
        step(c * cost)
        step_s += time.perf_counter() - a
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
    # Each time a thread of the main process blocks (on the GIL, a lock, a pipe) counts once: the hand-offs.
    switches = self1.ru_nvcsw - self0.ru_nvcsw
    workers_cpu = (child1.ru_utime - child0.ru_utime) + (child1.ru_stime - child0.ru_stime)
    return {"epoch_s": epoch, "loader_wait_s": wait, "wait_after_first_s": wait - first_wait,
            "loader_cpu_s": wait_cpu, "compute_s": c * padded, "step_s": step_s, "main_cpu_s": main_cpu,
            "workers_cpu_s": workers_cpu, "main_switches": switches, "first_batch_s": float(first or 0.0),
            "steps": steps, "samples": samples,
            "real_tokens": real, "padded_tokens": padded, "over_budget_batches": over, "max_batch_size": max_b}


def make_loaders(dataset: Dataset, budget: int, fit_b: int, mean_b: int, num_workers: int,
                 seed: int, worker_init_fn: Optional[Callable[[int], None]] = None
                 ) -> Dict[str, Callable[[], DataLoader]]:
    """Every arm's loader; ``worker_init_fn`` (the same for every arm) is None at the benchmark's defaults."""
    def plain(b: int) -> Callable[[], DataLoader]:
        return lambda: DataLoader(dataset, batch_size=b, shuffle=True, collate_fn=pad_collate,
                                  num_workers=num_workers, generator=torch.Generator().manual_seed(seed),
                                  worker_init_fn=worker_init_fn)

    def grouped() -> DataLoader:
        sampler = LengthGroupedSampler(fit_b, lengths=np.asarray(dataset.lengths).tolist(),
                                       generator=torch.Generator().manual_seed(seed))
        return DataLoader(dataset, batch_size=fit_b, sampler=sampler, collate_fn=pad_collate, num_workers=num_workers,
                          worker_init_fn=worker_init_fn)

    makers: Dict[str, Callable[[], DataLoader]] = {
        "odb": lambda: odb.ODBDataLoader(dataset, token_budget=budget, shuffle=True, seed=seed,
                                         collate_fn=pad_collate, num_workers=num_workers,
                                         worker_init_fn=worker_init_fn),
        "plain-fit": plain(fit_b),
    }
    if LengthGroupedSampler is not None:
        makers["length-grouped"] = grouped
    makers["plain-mean"] = plain(mean_b)
    return makers


def run_setting(name: str, ratio: float, step_kind: str, dataset: Dataset, data_s: float, budget: int, fit_b: int,
                mean_b: int, num_workers: int, repeats: int, gil_step: GilStep,
                progress: Callable[..., Any], worker_init_fn: Optional[Callable[[int], None]] = None
                ) -> Dict[str, Any]:
    real_total = int(np.asarray(dataset.lengths).sum())
    c = ratio * data_s / real_total  # seconds per padded token
    step: Callable[[float], None] = time.sleep if step_kind == "sleep" else gil_step
    makers = make_loaders(dataset, budget, fit_b, mean_b, num_workers, seed=0, worker_init_fn=worker_init_fn)
    names = list(makers)
    runs: Dict[str, List[Dict[str, float]]] = {k: [] for k in names}
    schedule = [(r, k) for r in range(repeats) for k in (names if r % 2 == 0 else names[::-1])]
    for _, k in progress(schedule, desc=f"end to end, {name}", unit="epoch"):
        runs[k].append(run_epoch(makers[k](), c, budget, k == "odb", step))
    med = {k: {f: statistics.median(r[f] for r in runs[k]) for f in runs[k][0]} for k in names}
    cpus = os.cpu_count() or 1
    for k, m in med.items():
        m["data_s"] = data_s
        # No schedule beats the CPU the epoch used spread over every core: the floor of a data-bound epoch.
        m["cpu_floor_s"] = (m["main_cpu_s"] + m["workers_cpu_s"]) / cpus
        m["ideal_s"] = max(data_s, m["compute_s"])
        m["overlap"] = m["epoch_s"] / m["ideal_s"]
        m["token_efficiency"] = m["real_tokens"] / m["padded_tokens"]
        m["mean_batch_size"] = m["samples"] / m["steps"]
    o, fit, mean = med["odb"], med["plain-fit"], med["plain-mean"]
    out: Dict[str, Any] = {"ratio": ratio, "step": step_kind, "seconds_per_padded_token": c, "median": med,
                           "runs": runs, "odb_vs_plain_fit": o["epoch_s"] / fit["epoch_s"],
                           "odb_vs_plain_mean": o["epoch_s"] / mean["epoch_s"]}
    if "length-grouped" in med:
        out["odb_vs_length_grouped"] = o["epoch_s"] / med["length-grouped"]["epoch_s"]
    met = {"overlap": o["overlap"] <= GOALS["overlap_max"]}
    if name.startswith("compute-bound"):
        met["faster_than_plain_fit"] = o["epoch_s"] < fit["epoch_s"]
        met["faster_than_plain_mean"] = o["epoch_s"] < mean["epoch_s"]
    else:
        met["vs_plain_fit"] = out["odb_vs_plain_fit"] <= GOALS["data_bound_slowdown_max"]
        met["vs_plain_mean"] = out["odb_vs_plain_mean"] <= GOALS["data_bound_slowdown_max"]
    out["goals_met"] = met
    return out


def setting_name(bound: str, step_kind: str) -> str:
    """``compute-bound`` (sleeping step), ``compute-bound, GIL-holding step``, ..."""
    return bound if step_kind == "sleep" else f"{bound}, GIL-holding step"


def run_e2e(samples: int, *, num_workers: int = 2, budget: int = 8192, mean_length: float = 600.0,
            cv: float = 1.0, max_len: int = 4096, repeats: int = 3, warm_up_samples: int = 128,
            step_kinds: Sequence[str] = STEP_KINDS,
            progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Both settings with each kind of step, every arm ``repeats`` times (order alternating); medians per arm."""
    lengths = lognormal_lengths(mean_length, cv, samples, seed=1, max_len=max_len)
    dataset = BusyDataset(lengths)
    fit_b = max(1, budget // int(lengths.max()))
    planned = [g for w in plan_stream(lengths, odb.ODBConfig(token_budget=budget)) for g in w.groups]
    mean_b = max(1, int(round(len(lengths) / len(planned))))
    data_cpu = data_cpu_s(dataset)
    data_s = data_cpu / num_workers
    gil_step = GilStep()
    small = BusyDataset(lengths[:warm_up_samples])
    for k, make in make_loaders(small, budget, fit_b, mean_b, num_workers, seed=0).items():
        run_epoch(make(), 0.0, budget, k == "odb")  # untimed: first fork, first batch of each kind
    settings = {}
    for step_kind in step_kinds:
        for bound, ratio in (("compute-bound", COMPUTE_RATIO), ("data-bound", DATA_RATIO)):
            name = setting_name(bound, step_kind)
            settings[name] = run_setting(name, ratio, step_kind, dataset, data_s, budget, fit_b, mean_b,
                                         num_workers, repeats, gil_step, progress)
    return {
        "samples": samples, "num_workers": num_workers, "token_budget": budget, "repeats": repeats,
        "logical_cpus": os.cpu_count(),
        "lengths": {"mean": float(lengths.mean()), "cv": float(lengths.std() / lengths.mean()),
                    "max": int(lengths.max()), "clip": [16, max_len]},
        "sample_cost": {"base_ms": dataset.base_s * 1e3, "per_token_us": dataset.per_token_s * 1e6,
                        "mean_ms": 1e3 * data_cpu / samples},
        "data_cpu_s": data_cpu, "data_s": data_s, "plain_fit_batch_size": fit_b, "plain_mean_batch_size": mean_b,
        "gil_step_rate": gil_step.rate, "goals": GOALS, "settings": settings,
    }
