"""Cost of loader.state_dict() mid-epoch, at a given number of retained samples.

Trainers may save the loader's state every step, so taking it must be cheap. The loader
holds a window's samples between reading and emitting (carried, planned, in the
current optimizer step); the state names them, so its cost grows with their number.
This script builds a loader whose first window holds --retained samples, takes one
batch, and times state_dict() (median of --repeats calls, with the batch thread alive
when --ready > 0, as in training), then json.dumps and torch.save of the result.

    PYTHONPATH=src python benchmarks/state_cost.py                 # 2,048 retained samples
    PYTHONPATH=src python benchmarks/state_cost.py --retained 8192 --ready 0
    PYTHONPATH=src python benchmarks/state_cost.py --stream        # an IterableDataset with its own state
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time

import numpy as np
import torch

import odb
from odb.bench.loader_speed import LengthDataset


class Stream(torch.utils.data.IterableDataset):
    """The same samples as a stream with its own state_dict()/load_state_dict() (the resume point)."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths, self.next, self.start = lengths, 0, 0

    def state_dict(self) -> dict:
        return {"next": self.next}

    def load_state_dict(self, state: dict) -> None:
        self.start = state["next"]

    def __iter__(self):
        for i in range(self.start, len(self.lengths)):
            self.next = i + 1
            yield {"input_ids": torch.ones(int(self.lengths[i]), dtype=torch.long)}


def held(state: dict) -> int:
    """Samples the state names (carried, in planned steps, the ghost)."""
    from odb.epoch.run_state import retained_positions

    return len(retained_positions(state["run"]))


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--retained", type=int, default=2048, help="samples the first window holds")
    parser.add_argument("--ready", type=int, default=4, help="ready_batches (0: no batch thread)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--stream", action="store_true", help="an IterableDataset with its own state")
    args = parser.parse_args()
    window = args.retained + 48  # the first batch leaves the window before the state is taken
    lengths = np.random.default_rng(0).integers(16, 512, size=window * 3)
    data = Stream(lengths) if args.stream else LengthDataset(lengths)
    loader = odb.ODBDataLoader(data, token_budget=16384, shuffle=not args.stream, seed=0, collate_fn=list,
                               buffer_size=window, window_budgets=None, first_window_size=window,
                               ready_batches=args.ready)
    batches = iter(loader)
    next(batches)
    time.sleep(0.5)  # let the batch thread fill its queue (it then waits, as during a training step)
    state = loader.state_dict()
    cost = timed(loader.state_dict, args.repeats)
    dumped = json.dumps(state)
    json_s = timed(lambda: json.dumps(state), 20)

    def save() -> None:
        torch.save(state, io.BytesIO())

    save_s = timed(save, 20)
    print(f"state_dict() with {held(state):,} retained samples ({'stream' if args.stream else 'map-style'}, "
          f"ready_batches={args.ready}): "
          f"{cost * 1e3:.3f} ms (median of {args.repeats})")
    print(f"  json.dumps: {json_s * 1e3:.3f} ms, {len(dumped) / 1024:.0f} KiB; torch.save: {save_s * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
