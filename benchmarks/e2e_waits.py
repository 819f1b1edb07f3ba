"""Where odb's training loop waits, step by step, in the end-to-end benchmark's compute-bound setting.

The same dataset, budget and workers as ``make demo``'s end-to-end section (``odb.bench.e2e``); the step is its
GIL-holding loop (``--step gil``, the default) or a sleep (``--step sleep``). Prints, per epoch, the epoch time, the total wait inside ``next(loader)`` and every wait over
20 ms with its step index, its time in the epoch and the samples odb held (``ODBStepInfo.buffered_samples``).

    PYTHONPATH=src python benchmarks/e2e_waits.py [--epochs 2] [--step gil|sleep]
"""

from __future__ import annotations

import argparse
import time
import warnings

import odb
from odb.loader.batch_checks import ShiftLabelsWarning
from odb.bench.e2e import COMPUTE_RATIO, BusyDataset, GilStep, data_cpu_s
from odb.bench.loader_speed import pad_collate
from odb.bench.workloads import lognormal_lengths


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--step", choices=("gil", "sleep"), default="gil")
    p.add_argument("--ready-batches", type=int, default=None, help="ODBConfig.ready_batches (default: odb's)")
    args = p.parse_args()
    warnings.simplefilter("ignore", ShiftLabelsWarning)  # labels repeat input_ids and no model shifts them here
    lengths = lognormal_lengths(600.0, 1.0, 2400, seed=1, max_len=4096)
    dataset = BusyDataset(lengths)
    c = COMPUTE_RATIO * (data_cpu_s(dataset) / 2) / int(lengths.sum())  # seconds per padded token
    step = GilStep() if args.step == "gil" else time.sleep
    for epoch in range(args.epochs):
        loader = odb.ODBDataLoader(dataset, token_budget=8192, shuffle=True, seed=0, collate_fn=pad_collate,
                                   num_workers=2,
                                   **({} if args.ready_batches is None else {"ready_batches": args.ready_batches}))
        t0 = time.perf_counter()
        batches = iter(loader)
        waits = []
        while True:
            a = time.perf_counter()
            batch = next(batches, None)
            wait = time.perf_counter() - a
            if batch is None:
                break
            info = odb.pop_step_info(batch)
            waits.append((len(waits), time.perf_counter() - t0, wait, info.buffered_samples))
            step(c * batch["input_ids"].numel())
        total = time.perf_counter() - t0
        print(f"epoch {epoch}: {total:.2f} s, {len(waits)} steps, waited {sum(w[2] for w in waits):.2f} s in next()")
        print("  waits over 20 ms (step, s into the epoch, wait s, samples held): "
              + ", ".join(f"({k}, {t:.2f}, {w:.3f}, {held})" for k, t, w, held in waits if w > 0.02))


if __name__ == "__main__":
    main()
