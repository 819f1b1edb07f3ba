"""Time odb's pure rank alignment for one window at many simulated ranks.

Per window, every rank runs decide_steps on the gathered header, step_imbalance on the
gathered (world, S, 3) step summaries, and global_steps (with the shared step order)
to build its own step plans. This times that work on one rank; the collectives are
not included.

    python benchmarks/align_bench.py [--world 1024] [--steps 30] [--windows 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from odb.align import decide_steps, global_steps, shared_step_order, step_imbalance


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
    assert len(plans) == n_steps and imbalance.shape == (n_steps,)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30, help="about this many steps per window")
    parser.add_argument("--windows", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    windows = [one_window(rng, args.world, args.steps, w) for w in range(args.windows)]
    for w in range(5):  # warm-up
        time_window(windows[w], 0, w)
    times = [time_window(inputs, w % args.world, w) * 1e3 for w, inputs in enumerate(windows)]
    s = windows[0][3].shape[1]
    print(f"align: world={args.world} S={s} stats=({args.world}, {s}, 3): median {statistics.median(times):.3f} ms "
          f"per window (p90 {np.percentile(times, 90):.3f} ms, {args.windows} windows)")


if __name__ == "__main__":
    main()
