"""Rank alignment: turns each rank's planned groups into the steps every rank runs.

Pure: integers in, step plans out. The single-process case passes groups through;
the distributed case (odb.comm.dist feeds it the exchanged summaries) gives every rank the
same number of steps per window and marks ghost steps.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class MicroBatchPlan:
    """One micro-batch of this rank with the figures of its micro-step over all ranks: which of its groups it
    runs (None: a ghost), the micro-step's samples and the optimizer step's supervised tokens over all ranks, this
    rank's own, and the micro-step's rank imbalance."""

    group: Optional[int]
    global_samples: int
    global_loss_tokens: int
    local_loss_tokens: int
    local_samples: int
    imbalance: float = 1.0  # max over ranks of this step's cost / their mean


def local_steps(loss_tokens: Sequence[int], samples: Sequence[int]) -> List[MicroBatchPlan]:
    """One rank on its own: every planned group is a step, with local numbers as global ones.

    Example:
        >>> [(s.group, s.global_samples) for s in local_steps([5, 4], [2, 2])]
        [(0, 2), (1, 2)]
    """
    return [MicroBatchPlan(g, int(n), int(t), int(t), int(n)) for g, (t, n) in enumerate(zip(loss_tokens, samples))]


def decide_steps(n_groups: Sequence[int], must_emit: Sequence[int], exhausted: Sequence[bool]) -> int:
    """Steps every rank runs for this window (the same answer on every rank).

    Before any rank's data ends, the count is the smallest rank's (others defer their
    least-packed groups to the next window) unless a rank cannot defer (its pool is
    full): then that rank's need wins and lighter ranks split groups. Once a rank's
    data has ended, nobody defers: the count is the largest rank's, and ranks with too
    few groups split theirs, or run ghost steps when they have too few samples.

    Example:
        >>> decide_steps([30, 28, 29], [25, 26, 27], [False, False, False])
        28
        >>> decide_steps([3, 0], [3, 0], [True, True])
        3
    """
    if any(exhausted):
        return int(max(n_groups))
    return int(max(min(n_groups), max(must_emit)))


def shared_step_order(n_steps: int, seed: int, epoch: int, window: int, shuffle: bool) -> np.ndarray:
    """Permutation of cost-ranked steps, identical on every rank.

    Every rank ranks its groups by decreasing cost, so step k pairs groups of similar
    cost across ranks; this permutation then shuffles the steps.
    """
    if not shuffle:
        return np.arange(n_steps)
    return np.random.default_rng([seed, epoch, window, 7]).permutation(n_steps)


def global_steps(stats: np.ndarray, rank: int, order: np.ndarray, groups_by_rank_order: Sequence[Optional[int]]
                 ) -> List[MicroBatchPlan]:
    """StepPlans of one rank from every rank's per-step stats.

    stats: (world, S, 3) int array of (cost, samples, loss_tokens) in each rank's
    cost-ranked order; order: the shared permutation; groups_by_rank_order: this
    rank's group index (None: ghost) at each cost rank.
    """
    steps = []
    imbalance = step_imbalance(stats)
    for k in order.tolist():
        col = stats[:, k, :]
        g = groups_by_rank_order[k]
        steps.append(MicroBatchPlan(g, int(col[:, 1].sum()), int(col[:, 2].sum()), int(stats[rank, k, 2]),
                              int(stats[rank, k, 1]), float(imbalance[k])))
    return steps


def step_imbalance(stats: np.ndarray) -> np.ndarray:
    """Per step: max over ranks of cost / mean over ranks of cost (1.0 = balanced)."""
    costs = stats[:, :, 0].astype(np.float64)
    mean = costs.mean(axis=0)
    return np.where(mean > 0, costs.max(axis=0) / np.maximum(mean, 1e-9), 1.0)
