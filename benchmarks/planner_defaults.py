"""odb's padded planner at the old defaults (emit at 0.95, carry at most half a window) and the
new ones (0.99, a full window), beside LengthGroupedSampler: token efficiency, samples read before
the 10th batch, peak tokens held. One seeded shuffle of a seeded subsample per row, budget 16,384.

    PYTHONPATH=src python benchmarks/planner_defaults.py
"""

from __future__ import annotations

import numpy as np

from odb import ODBConfig
from odb.bench.planning import _subsample, fixed_batch_size, length_grouped_batches, load_workloads
from odb.window import plan_stream

BUDGET = 16384
ROWS = [("lognormal-cv0.29", 600), ("lognormal-cv0.29", 2000), ("lognormal-cv1.00", 2000), ("sharegpt-gpt2", 2000),
        ("lognormal-cv1.00", 20000), ("pareto-a1.2", 20000)]


def run(x: np.ndarray, cfg: ODBConfig):
    xs = x[np.random.default_rng(0).permutation(len(x))]
    tot = xs.sum(axis=1)
    read = read_tokens = emitted_tokens = batches = peak = 0
    real = padded = 0
    before_10 = None
    for w in plan_stream(xs, cfg):
        read_tokens += int(tot[read:read + w.new_samples].sum())
        read += w.new_samples
        for g in w.groups:
            batches += 1
            real += int(tot[g].sum())
            padded += len(g) * int(xs[g].max(axis=0).sum())
            if batches == 10:
                before_10 = read
        peak = max(peak, read_tokens - emitted_tokens)
        emitted_tokens += sum(int(tot[g].sum()) for g in w.groups)
    return real / padded, before_10, peak / BUDGET


def main() -> None:
    workloads = load_workloads(20000, log=lambda m: None)
    print("| workload | samples | 0.95, half carry | 0.99, full carry | LengthGrouped | reads before batch 10 | "
          "peak held tokens / budget |")
    print("|---|---|---|---|---|---|---|")
    for name, n in ROWS:
        x = _subsample(workloads[name], n, 0)
        full = ODBConfig(token_budget=BUDGET)
        half = int(min(full.buffer_size, -(-full.window_tokens * len(x) // int(x.sum()))) // 2)
        old = run(x, ODBConfig(token_budget=BUDGET, pack_efficiency=0.95, max_carry=half))
        new = run(x, full)
        grouped = length_grouped_batches(x, fixed_batch_size(x, BUDGET), 0)
        lg = sum(int(x[g].sum()) for g in grouped) / sum(len(g) * int(x[g].max(axis=0).sum()) for g in grouped)
        print(f"| {name} | {n} | {old[0]:.3f} | {new[0]:.3f} | {lg:.3f} | {old[1]} -> {new[1]} | "
              f"{old[2]:.0f} -> {new[2]:.0f} |")


if __name__ == "__main__":
    main()
