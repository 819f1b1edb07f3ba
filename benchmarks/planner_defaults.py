"""odb's padded planner at the old defaults (emit at 0.95, carry at most half a window) and the
new ones (0.99, a full-window carry, the best 0.95 runs of the carry added to a window that would
emit under 55% of its new samples), beside LengthGroupedSampler: token efficiency, samples read before
the 10th batch, peak tokens held. One seeded shuffle of a seeded subsample per row, budget 16,384.

A second table models what the slower ramp costs a training loop on a short epoch (the
end-to-end benchmark's workload: 2,400 samples, lognormal mean 600, CV 1.0, budget 8,192):
samples arrive at a constant rate (1 ms each), a window's batches can train once its last
sample has arrived, a step takes c x its padded tokens, with c set so that padding-free
compute is 1.6x (compute-bound) or 0.25x (data-bound) the data time. It is a model (no
threads, no planning time), not a measurement: ``python -m odb.bench`` measures the real loop.

    PYTHONPATH=src python benchmarks/planner_defaults.py
"""

from __future__ import annotations

import numpy as np

from odb import ODBConfig
from odb.bench.planning import _subsample, fixed_batch_size, length_grouped_batches, load_workloads
from odb.bench.workloads import lognormal_lengths
from odb.plan.windows.window import plan_stream

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


def modelled_epoch(x: np.ndarray, cfg: ODBConfig, read_s: float, c: float) -> tuple:
    """(epoch seconds, seconds the loop waited) of the model in the module docstring."""
    t = wait = 0.0
    read = 0
    for w in plan_stream(x, cfg):
        read += w.new_samples
        ready = read * read_s
        for g in w.groups:
            if t < ready:
                wait, t = wait + ready - t, ready
            t += c * len(g) * int(x[g].max())
    return t, wait


def old_config(budget: int, x: np.ndarray) -> ODBConfig:
    full = ODBConfig(token_budget=budget)
    half = int(min(full.buffer_size, -(-full.window_tokens * len(x) // int(x.sum()))) // 2)
    return ODBConfig(token_budget=budget, pack_efficiency=0.95, max_carry=half)


def main() -> None:
    workloads = load_workloads(20000, log=lambda m: None)
    print("| workload | samples | 0.95, half carry | new defaults | LengthGrouped | reads before batch 10 | "
          "peak held tokens / budget |")
    print("|---|---|---|---|---|---|---|")
    for name, n in ROWS:
        x = _subsample(workloads[name], n, 0)
        old = run(x, old_config(BUDGET, x))
        new = run(x, ODBConfig(token_budget=BUDGET))
        grouped = length_grouped_batches(x, fixed_batch_size(x, BUDGET), 0)
        lg = sum(int(x[g].sum()) for g in grouped) / sum(len(g) * int(x[g].max(axis=0).sum()) for g in grouped)
        print(f"| {name} | {n} | {old[0]:.3f} | {new[0]:.3f} | {lg:.3f} | {old[1]} -> {new[1]} | "
              f"{old[2]:.0f} -> {new[2]:.0f} |")
    x = lognormal_lengths(600.0, 1.0, 2400, seed=1, max_len=4096)[:, None]
    read_s, budget = 1e-3, 8192
    print("\n| setting | 0.95, half carry: epoch / ideal (loop wait s) | new defaults |")
    print("|---|---|---|")
    for name, ratio in (("compute-bound (1.6)", 1.6), ("data-bound (0.25)", 0.25)):
        data = len(x) * read_s
        c = ratio * data / int(x.sum())
        ideal = max(data, ratio * data)
        cells = [modelled_epoch(x, cfg, read_s, c) for cfg in (old_config(budget, x), ODBConfig(token_budget=budget))]
        print(f"| {name} | " + " | ".join(f"{t / ideal:.3f} ({w:.2f})" for t, w in cells) + " |")


if __name__ == "__main__":
    main()
