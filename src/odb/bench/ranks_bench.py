"""Distributed figures: N ranks simulated in one process, and the alignment's cost.

simulate_ranks runs the real engine of every rank (a thread each, one exchange per
window) over lengths alone. Figures: rank imbalance (mean
over steps of max/mean step cost across ranks), ghost fraction, steps, useful fill.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict

import numpy as np

from odb.plan.ranks.align import decide_steps, global_steps, shared_step_order, step_imbalance
from odb.config import ODBConfig
from odb.epoch.simulate import simulate_ranks


def run_ranks(workloads: Dict[str, np.ndarray], world: int = 8, budget: int = 16384, buffer_size: int = 512,
              align_world: int = 1024, align_windows: int = 100,
              progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Per workload: steps, imbalance (mean, p95), ghost fraction (max over ranks), useful fill."""
    out: Dict[str, Any] = {"world": world, "budget": budget, "buffer_size": buffer_size, "workloads": {}}
    cfg = ODBConfig(token_budget=budget, buffer_size=buffer_size)
    for name, lengths in progress(list(workloads.items()), desc="ranks", unit="workload"):
        lengths = np.asarray(lengths)
        shards = [lengths[r::world] for r in range(world)]
        sim = simulate_ranks(shards, cfg, seed=0)
        costs = np.array([[0 if i.is_ghost else i.padded_tokens for i in infos] for infos in sim["infos"]])
        mean = costs.mean(axis=0)
        ratio = np.where(mean > 0, costs.max(axis=0) / np.maximum(mean, 1e-9), 1.0)
        steps = len(sim["infos"][0])
        out["workloads"][name] = {
            "steps": steps, "imbalance_mean": float(ratio.mean()), "imbalance_p95": float(np.percentile(ratio, 95)),
            "ghost_fraction_max": max(s["ghost_fraction"] for s in sim["stats"]),
            "useful_fill": float(lengths.sum() / (steps * world * budget)),
            "split_groups": sum(s["split_groups"] for s in sim["stats"])}
    out["align_ms_per_window"] = time_alignment(align_world, 30, align_windows)
    out["align_world"] = align_world
    return out


def time_alignment(world: int, steps: int, windows: int) -> float:
    """Median ms of one rank's pure alignment work per window at ``world`` ranks."""
    rng = np.random.default_rng(0)
    inputs = [one_window(rng, world, steps, w) for w in range(windows)]
    for w in range(min(5, windows)):
        time_window(inputs[w], 0, w)
    return statistics.median(time_window(x, w % world, w) * 1e3 for w, x in enumerate(inputs))


def one_window(rng: np.random.Generator, world: int, steps: int, window: int) -> tuple:
    """Gathered inputs of one window: header columns and the (world, S, 3) step summaries."""
    n_groups = rng.integers(steps, steps + 4, size=world)
    must = rng.integers(0, steps, size=world)
    exhausted = np.zeros(world, dtype=bool)
    n_steps = decide_steps(n_groups, must, exhausted)
    stats = np.stack([rng.integers(8000, 16385, size=(world, n_steps)), rng.integers(1, 40, size=(world, n_steps)),
                      rng.integers(1000, 16000, size=(world, n_steps))], axis=2).astype(np.int64)
    stats[rng.random((world, n_steps)) < 0.01] = 0  # a few ghost steps
    return n_groups, must, exhausted, stats


def time_window(inputs: tuple, rank: int, window: int) -> float:
    n_groups, must, exhausted, stats = inputs
    start = time.perf_counter()
    n_steps = decide_steps(n_groups, must, exhausted)
    imbalance = step_imbalance(stats)
    order = shared_step_order(n_steps, 1234, 0, window, True)
    slots = [k if stats[rank, k, 1] else None for k in range(n_steps)]
    plans = global_steps(stats, rank, order, slots)
    elapsed = time.perf_counter() - start
    if len(plans) != n_steps or imbalance.shape != (n_steps,):
        raise RuntimeError('alignment returned the wrong number of steps')
    return elapsed
