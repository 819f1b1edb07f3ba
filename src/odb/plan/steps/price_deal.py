"""Deal a step's planned micro-batches to ranks again by another price (``balance="time"``'s predicted
seconds), keeping the plan's micro-batches and its micro-step count.

The global step plan (odb.plan.steps.global_plan) cuts a step by the planner's cost (padded tokens, side
costs, a fixed cost per micro-batch). Where the ranks price micro-batches by predicted time and every
rank's model predicts, the same micro-batches are dealt again so the slowest rank's predicted time is
least: the costliest first, each to the rank of least predicted time that still has a free micro-step
(longest processing time first, with equal counts), and each rank's micro-batches in falling price,
so micro-step j holds every rank's j-th costliest (FSDP meets at every micro-step). Pure: every rank
computes the same deal from the same prices.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

from odb.plan.steps.global_plan import GlobalStepPlan

__all__ = ["deal_by_price", "planned_groups"]


def planned_groups(plan: GlobalStepPlan) -> List[np.ndarray]:
    """The plan's micro-batches that hold samples, rank by rank and micro-step by micro-step (the order in
    which prices are given to ``deal_by_price``)."""
    return [g for groups in plan.ranks for g in groups if len(g)]


def deal_by_price(plan: GlobalStepPlan, prices: np.ndarray, costs: np.ndarray, overhead: float) -> GlobalStepPlan:
    """``plan``'s micro-batches dealt to its ranks by ``prices`` (one per ``planned_groups(plan)``), each rank
    keeping ``plan.micro_steps`` micro-batches (ghosts where it has fewer); ``costs``: the same micro-batches'
    planner costs, which give the new ``rank_costs`` (each micro-step, a ghost's too, adds ``overhead``).

    Example:
        >>> a, b, c, d = (np.array([i]) for i in range(4))
        >>> ghost = np.empty(0, dtype=np.int64)
        >>> plan = GlobalStepPlan([[a, b], [c, d]], ghost, np.zeros(2), 0.0)
        >>> dealt = deal_by_price(plan, np.array([9, 8, 1, 2]), np.array([9.0, 8.0, 1.0, 2.0]), 0.0)
        >>> [[g.tolist() for g in groups] for groups in dealt.ranks], dealt.rank_costs.tolist()
        ([[[0], [2]], [[1], [3]]], [10.0, 10.0])
    """
    groups = planned_groups(plan)
    world, m = len(plan.ranks), plan.micro_steps
    prices = np.asarray(prices, dtype=np.float64)
    if len(prices) != len(groups) or len(costs) != len(groups):
        raise ValueError(f"deal_by_price got {len(prices)} prices and {len(costs)} costs for {len(groups)} "
                         f"micro-batches: one each, in planned_groups order. Fix: price every planned micro-batch.")
    totals = np.zeros(world)
    held: List[List[Tuple[float, int]]] = [[] for _ in range(world)]
    for k in sorted(range(len(groups)), key=lambda k: (-prices[k], k)):
        open_ranks = [r for r in range(world) if len(held[r]) < m]
        r = min(open_ranks, key=lambda r: (totals[r], r))
        totals[r] += prices[k]
        held[r].append((float(prices[k]), k))
    ghost = np.empty(0, dtype=np.int64)
    ranks = [[groups[k] for _, k in sorted(h, key=lambda x: (-x[0], x[1]))] + [ghost] * (m - len(h)) for h in held]
    rank_costs = np.array([sum(float(costs[k]) for _, k in h) + m * overhead for h in held])
    return GlobalStepPlan(ranks, plan.oversize, rank_costs, plan.bound)
