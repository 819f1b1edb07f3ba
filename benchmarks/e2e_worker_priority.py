"""End to end with a GIL-holding step, workers at normal and at lowered priority (every arm alike).

With a training step that keeps a core busy (a Python loop holding the GIL) and 2 workers on a
2-core machine, three threads compete for two cores and the operating system shares them fairly:
the step runs slower than its nominal time while the workers read. This script runs the
end-to-end benchmark's compute-bound setting with the GIL-holding step (``odb.bench.e2e``, the
same dataset, arms and repeats as ``make demo``) twice: at the defaults, and with every arm's
workers lowered to ``nice +10`` by a ``worker_init_fn`` (``os.nice(10)``, set by the user, never
by odb), and prints each arm's epoch, overlap and step time.

    PYTHONPATH=src python benchmarks/e2e_worker_priority.py [--repeats 3] [--samples 2400]
"""

from __future__ import annotations

import argparse
import os

import odb
from odb.bench.e2e import COMPUTE_RATIO, BusyDataset, GilStep, data_cpu_s, make_loaders, run_epoch, run_setting
from odb.bench.workloads import lognormal_lengths
from odb.plan.windows.window import plan_stream


def lower_priority(_worker_id: int) -> None:
    os.nice(10)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=2400)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    budget, workers = 8192, 2
    lengths = lognormal_lengths(600.0, 1.0, args.samples, seed=1, max_len=4096)
    dataset = BusyDataset(lengths)
    fit_b = max(1, budget // int(lengths.max()))
    planned = [g for w in plan_stream(lengths, odb.ODBConfig(token_budget=budget)) for g in w.groups]
    mean_b = max(1, int(round(len(lengths) / len(planned))))
    data_s = data_cpu_s(dataset) / workers
    gil = GilStep()
    small = BusyDataset(lengths[:128])
    for k, make in make_loaders(small, budget, fit_b, mean_b, workers, seed=0).items():
        run_epoch(make(), 0.0, budget, k == "odb")
    print(f"{args.samples} samples, 2 workers, {os.cpu_count()} CPUs, data time {data_s:.2f} s, "
          f"load average {os.getloadavg()[0]:.1f}; medians of {args.repeats}")
    print(f"{'workers':10} {'arm':15} {'epoch s':>8} {'overlap':>8} {'step s':>7} {'compute s':>9} {'CPU floor s':>11}")
    for label, init in (("default", None), ("nice +10", lower_priority)):
        st = run_setting("compute-bound, GIL-holding step", COMPUTE_RATIO, "gil", dataset, data_s, budget, fit_b,
                         mean_b, workers, args.repeats, gil, lambda it, **kw: it, worker_init_fn=init)
        for arm, m in st["median"].items():
            print(f"{label:10} {arm:15} {m['epoch_s']:8.2f} {m['overlap']:8.2f} {m['step_s']:7.2f} "
                  f"{m['compute_s']:9.2f} {m['cpu_floor_s']:11.2f}")


if __name__ == "__main__":
    main()
