"""Rank alignment: turns each rank's planned groups into the steps every rank runs.

Pure: integers in, step plans out. The single-process case passes groups through;
the distributed case (odb.dist feeds it the exchanged summaries) gives every rank the
same number of steps per window and marks ghost steps.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class WindowSummary:
    """What one rank tells the others about one window (a few integers per group)."""

    costs: Sequence[int]  # padded tokens per planned group, in the rank's emit order
    loss_tokens: Sequence[int]
    samples: Sequence[int]
    exhausted: bool  # the rank's data has ended (this is its final window or later)


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One step of this rank: which of its groups it runs (None: a ghost step)."""

    group: Optional[int]
    global_samples: int
    global_loss_tokens: int
    local_loss_tokens: int
    local_samples: int


@dataclasses.dataclass(frozen=True)
class Alignment:
    steps: List[StepPlan]
    deferred: List[int]  # groups of this rank not run this window (planned again later)
    all_exhausted: bool


def align_single(summary: WindowSummary) -> Alignment:
    """One rank: every group is a step.

    Example:
        >>> a = align_single(WindowSummary([10, 8], [5, 4], [2, 2], exhausted=True))
        >>> [s.group for s in a.steps], a.all_exhausted
        ([0, 1], True)
    """
    steps = [StepPlan(g, int(summary.samples[g]), int(summary.loss_tokens[g]), int(summary.loss_tokens[g]),
                      int(summary.samples[g])) for g in range(len(summary.costs))]
    return Alignment(steps, [], summary.exhausted)


def loss_tokens_total(steps: Sequence[StepPlan]) -> int:
    return int(np.sum([s.global_loss_tokens for s in steps])) if steps else 0
