"""How much the order of odb's batches follows length: the Spearman rank correlation between a batch's
position in the epoch and its mean length (the benchmark's "order rho"), over 20 loader seeds.

    PYTHONPATH=src python benchmarks/order_drift.py

Each benchmark workload at 20,000 samples (ShareGPT: all 17,545) and at 2,000 (a seeded subsample: a short
epoch), budget 16,384, odb at its defaults through ``ODBDataLoader`` (``odb.bench.planning.odb_loader_run``,
its own shuffle, seeds 0-19). Beside it, the same batches in a random order: what noise alone gives for as many
batches. A mean far from 0 is a drift; a spread wider than the random order's means that batches of one window
(shuffled among themselves) differ in length from those of the next.

A second table shows where the encoder-decoder epoch's batches come from: ``odb.plan.windows.window.plan_stream`` (the
loader's planning, which the benchmark checks plans the loader's batches) over one seeded shuffle (seed 0) of the
20,000 pairs, window by window: new samples, batches emitted, their mean length.
"""

from __future__ import annotations

import numpy as np

import odb
from odb.bench.planning import _subsample, load_workloads, odb_loader_run, spearman
from odb.bench.report import order_rho_max
from odb.plan.windows.window import plan_stream

BUDGET = 16384
SEEDS = range(20)


def main() -> None:
    cfg = odb.ODBConfig(token_budget=BUDGET)
    print("| workload | samples | batches | rho, mean over seeds | sd | max abs | seeds over the bound | "
          "random order: sd | max abs |")
    print("|---|---|---|---|---|---|---|---|---|")
    workloads = load_workloads(20000, log=lambda m: None)
    for n in (20000, 2000):
        for name, lengths in workloads.items():
            x = _subsample(lengths, n, 0)
            totals = x.sum(axis=1)
            rho, noise, steps, over = [], [], [], 0
            for seed in SEEDS:
                batches = odb_loader_run(x, cfg, seed=seed)["batches"]
                means = np.array([totals[b].mean() for b in batches])
                rho.append(spearman(np.arange(len(batches)), means))
                noise.append(spearman(np.arange(len(batches)), np.random.default_rng(seed).permutation(means)))
                steps.append(len(batches))
                over += abs(rho[-1]) > order_rho_max(len(batches))
            rho, noise = np.array(rho), np.array(noise)
            print(f"| {name} | {len(x)} | {min(steps)}-{max(steps)} | {rho.mean():+.3f} | {rho.std():.3f} | "
                  f"{np.abs(rho).max():.2f} | {over} of {len(rho)} | {noise.std():.3f} | {np.abs(noise).max():.2f} |",
                  flush=True)
    x = workloads["encdec-synthetic"]
    x = x[np.random.default_rng(0).permutation(len(x))]
    totals = x.sum(axis=1)
    print("\n| encdec-synthetic, window | new samples | batches | mean length of their samples |\n|---|---|---|---|")
    for k, window in enumerate(plan_stream(x, cfg)):
        ids = np.concatenate(window.groups) if window.groups else np.zeros(0, dtype=np.int64)
        mean = f"{totals[ids].mean():.1f}" if len(ids) else "-"
        print(f"| {k} | {window.new_samples} | {len(window.groups)} | {mean} |")


if __name__ == "__main__":
    main()
