"""One optimizer step planned over every rank (``OptimizerStepPlan``): what every step planner returns.

A step's samples (all ranks' together, indexed ``0..n-1``) are dealt to W ranks x M micro-steps:
``ranks[r][j]`` holds the indices rank r runs at micro-step j, an empty array a ghost micro-batch (the rank
runs an empty forward so its collectives stay aligned). The loader's step planned across ranks
(``odb.plan.steps.global_plan.GlobalStepPlan``) and an RL trainer's rollout rows, per rank or moving between
ranks (``odb.plan.rollouts``), are this one value with what each adds (costs, bounds, widths).

Example:
    >>> plan = OptimizerStepPlan([[np.array([0, 3]), np.array([1])], [np.array([2]), np.empty(0, dtype=np.int64)]])
    >>> plan.world, plan.micro_steps, plan.ghosts, plan.micro_samples().tolist()
    (2, 2, 1, [3, 1])
    >>> plan.moved(np.array([0, 0, 1, 1]))   # sample 3 is rank 1's and runs on rank 0
    1
"""

from __future__ import annotations

import dataclasses
from typing import List

import numpy as np

__all__ = ["OptimizerStepPlan"]


@dataclasses.dataclass(frozen=True)
class OptimizerStepPlan:
    """Every rank's micro-batches of one optimizer step (see the module docstring)."""

    ranks: List[List[np.ndarray]]

    @property
    def world(self) -> int:
        """W: the ranks the step is planned over."""
        return len(self.ranks)

    @property
    def micro_steps(self) -> int:
        """M: the number of micro-batches of every rank."""
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def ghosts(self) -> int:
        """How many micro-batches are ghosts (empty), over all ranks."""
        return sum(1 for groups in self.ranks for g in groups if len(g) == 0)

    def micro_samples(self) -> np.ndarray:
        """(M,) the samples of each micro-step over all ranks (the step info's ``all_samples_this_step``)."""
        out = np.zeros(self.micro_steps, dtype=np.int64)
        for groups in self.ranks:
            for j, g in enumerate(groups):
                out[j] += len(g)
        return out

    def samples_of(self, rank: int) -> np.ndarray:
        """The indices rank ``rank`` runs this step, in micro-step order."""
        groups = self.ranks[rank]
        return np.concatenate(groups).astype(np.int64) if groups else np.zeros(0, dtype=np.int64)

    def moved(self, home: np.ndarray) -> int:
        """How many samples run on another rank than ``home[i]``, the rank sample i came from."""
        home = np.asarray(home)
        return sum(int((home[self.samples_of(r)] != r).sum()) for r in range(self.world))
