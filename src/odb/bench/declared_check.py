"""What checking declared ``lengths=`` costs the loader: samples/s of a known-lengths odb loader with the check
(as it ships) and with it turned off, side by side.

With ``lengths=`` odb plans before reading and its workers collate whole planned batches; each worker measures
every sample it loads (``length_fn``, default ``input_ids``) and compares it with the declared length
(``odb.data.declared.DeclaredLengthCheck``). The "unchecked" arm replaces that comparison by a no-op for the
duration of its epochs (the workers fork after it, so they run it too): the only difference between the arms.
The dataset and collate are the loader benchmark's (``odb.bench.loader_speed``: a nearly free dataset, a Python
collate), so the loader's own work is what the check is set against. Epochs alternate between the arms.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any, Dict, Iterator, List, Sequence

import numpy as np

import odb
from odb.bench.loader_speed import FreeDataset, measure_epoch, python_collate
from odb.data.declared import DeclaredLengthCheck

GOAL_COST_MAX = 0.01  # the check costs at most 1% of the loader's samples/s


@contextlib.contextmanager
def check_off() -> Iterator[None]:
    """``DeclaredLengthCheck`` compares nothing inside the block (the benchmark's "unchecked" arm)."""
    original = DeclaredLengthCheck.__call__
    DeclaredLengthCheck.__call__ = lambda self, index, declared, sample: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        DeclaredLengthCheck.__call__ = original  # type: ignore[method-assign]


def run_declared_check(lengths: Sequence[int], *, num_workers: int = 2, budget: int = 16384, repeats: int = 5
                       ) -> Dict[str, Any]:
    """Both arms, ``repeats`` epochs each, alternating; medians with min-max, and the check's cost:
    1 - checked / unchecked samples/s (negative: within noise, the checked arm was the faster). Beside it, the
    CPU of one sample's check against the loader's CPU per sample (all processes), which the load of the machine
    blurs less than samples/s."""
    lengths = np.asarray(lengths, dtype=np.int64)
    dataset = FreeDataset(lengths)

    def make() -> Any:
        return odb.ODBDataLoader(dataset, token_budget=budget, shuffle=True, seed=0, collate_fn=python_collate,
                                 num_workers=num_workers, lengths=lengths.tolist())

    measure_epoch(make)  # warm-up, untimed
    runs: Dict[str, List[float]] = {"checked": [], "unchecked": []}
    cpu: Dict[str, List[float]] = {"checked": [], "unchecked": []}
    for r in range(repeats):
        for arm in (("checked", "unchecked") if r % 2 == 0 else ("unchecked", "checked")):
            with check_off() if arm == "unchecked" else contextlib.nullcontext():
                epoch = measure_epoch(make)
            runs[arm].append(epoch["samples_per_s"])
            cpu[arm].append(1e6 * epoch["cpu_s"] / epoch["samples"])
    med = {arm: statistics.median(v) for arm, v in runs.items()}
    cost = 1.0 - med["checked"] / med["unchecked"]
    per_round = [1.0 - c / u for c, u in zip(runs["checked"], runs["unchecked"])]
    check_us = check_cpu_us(dataset, lengths)
    loader_us = statistics.median(cpu["checked"])
    return {"samples": len(lengths), "num_workers": num_workers, "token_budget": budget, "repeats": repeats,
            "samples_per_s": med, "runs": runs, "cost": cost, "cost_rounds": [min(per_round), max(per_round)],
            "cpu_us_per_sample": {arm: statistics.median(v) for arm, v in cpu.items()},
            "check_cpu_us_per_sample": check_us, "check_cpu_share": check_us / loader_us,
            "goal_cost_max": GOAL_COST_MAX, "goal_met": cost <= GOAL_COST_MAX}


def check_cpu_us(dataset: FreeDataset, lengths: np.ndarray, samples: int = 20000) -> float:
    """CPU microseconds of one sample's check (``DeclaredLengthCheck`` over the dataset's samples, in a loop): what
    every arm's workers add per sample, without the machine's noise in the epochs' samples/s."""
    check = DeclaredLengthCheck(None)
    n = min(samples, len(lengths))
    items = [(i, (int(lengths[i]),), dataset[i]) for i in range(n)]
    t0 = time.process_time()
    for index, declared, sample in items:
        check(index, declared, sample)
    return 1e6 * (time.process_time() - t0) / n
