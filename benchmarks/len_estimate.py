"""len(loader) before the first epoch against the real step count, through ODBDataLoader itself.

    PYTHONPATH=src python benchmarks/len_estimate.py

20,000 samples of each benchmark workload (ShareGPT: all 17,545), budget 16,384, default
options, no lengths given: len() reads a probe of the dataset (odb.plan.windows.estimate) in the workers.
"""

from __future__ import annotations

import numpy as np
import torch

import odb
from odb.bench.planning import load_workloads


class Lengths(torch.utils.data.Dataset):
    """Sample i has input_ids of lengths[i, 0] tokens (and labels of lengths[i, -1])."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": torch.zeros(int(self.lengths[i, 0]), dtype=torch.long),
                "labels": torch.zeros(int(self.lengths[i, -1]), dtype=torch.long)}


def count(samples: list) -> list:
    return [len(samples)]


def main() -> None:
    print("| workload | len() before the epoch | real steps | error |\n|---|---|---|---|")
    for name, lengths in load_workloads(20000, real=True, log=lambda m: None).items():
        lengths = np.asarray(lengths).reshape(len(lengths), -1)
        extra = {"length_fn": odb.seq2seq_lengths} if lengths.shape[1] == 2 else {}
        loader = odb.ODBDataLoader(Lengths(lengths), token_budget=16384, shuffle=True, seed=0, collate_fn=count,
                                   num_workers=2, **extra)
        estimate = len(loader)
        real = sum(1 for _ in loader)
        print(f"| {name} | {estimate} | {real} | {estimate / real - 1:+.1%} |", flush=True)


if __name__ == "__main__":
    main()
