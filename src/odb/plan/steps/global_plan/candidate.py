"""A candidate plan of one step: its micro-batches dealt to (rank, micro-step) cells, scored and compared;
the chosen one emitted as a ``GlobalStepPlan``; the lower bound on any plan's slowest rank."""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import List, Optional, Tuple

import numpy as np

from odb.plan.steps.global_plan.result import _EMPTY, GlobalStepPlan

_MAX_TRIES = 3  # candidate M values tried past the last one that improved the slowest rank
_IMPROVE_STEPS = 32  # local-search moves on the slowest rank


@dataclasses.dataclass
class _Candidate:
    """K micro-batches (cost order is decided by ``_deal``) and where dealing put them."""

    # positions into the step's samples; may hold fewer than W x M (the rest: ghosts). Padded: None until the
    # chosen candidate is emitted (its runs, then the samples planned alone)
    groups: Optional[List[np.ndarray]]
    costs: np.ndarray  # (len(groups),) their group costs (planning precision)
    micro_steps: int
    rank_of: np.ndarray = None  # (len(groups),)
    slot_of: np.ndarray = None
    slowest: float = math.inf  # the slowest rank's cost (DDP's step time)
    meet: float = math.inf  # sum over micro-steps of the costliest micro-batch plus overhead (FSDP's step time)
    runs: Optional[np.ndarray] = None  # padded: (len, 2) starts and ends of the first len(runs) groups as runs of the
    # sorted samples


def _deal(costs: np.ndarray, world: int, micro_steps: int, overhead: float
          ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rank, micro-step) of each micro-batch and the ranks' totals: by cost, micro-step j takes the j-th W
    micro-batches (ghosts, cost 0, last) and gives the costliest to the rank with the least total so far.

    Example:
        >>> rank, slot, totals = _deal(np.array([5.0, 9.0, 4.0, 1.0]), 2, 2, 0.0)
        >>> rank.tolist(), slot.tolist(), totals.tolist()
        ([1, 0, 1, 0], [0, 0, 1, 1], [10.0, 9.0])
    """
    k = len(costs)
    cells = world * micro_steps
    full = np.zeros(cells)
    full[:k] = costs
    order = np.lexsort((np.arange(cells), -full))  # costliest first, ties by index (deterministic)
    rank_of = np.empty(cells, dtype=np.int64)
    slot_of = np.empty(cells, dtype=np.int64)
    totals = np.zeros(world)
    for j in range(micro_steps):
        idx = order[j * world:(j + 1) * world]
        by_total = np.argsort(totals, kind="stable")
        rank_of[idx] = by_total
        slot_of[idx] = j
        totals[by_total] += full[idx]
    return rank_of[:k], slot_of[:k], totals + micro_steps * overhead


def _deal_by_rank(costs: np.ndarray, world: int, micro_steps: int) -> Tuple[np.ndarray, np.ndarray]:
    """(rank, micro-step) of each micro-batch when there are ghosts: costliest first, each to the rank with the
    least total among those with a free micro-step (so a rank with a costly micro-batch takes the ghosts); a
    rank runs its micro-batches costliest first.

    Example:
        >>> rank, slot = _deal_by_rank(np.array([9.0, 4.0, 3.0]), 2, 2)
        >>> rank.tolist(), slot.tolist()
        ([0, 1, 1], [0, 0, 1])
    """
    order = np.lexsort((np.arange(len(costs)), -costs))
    heap = [(0.0, r) for r in range(world)]
    held = [0] * world
    rank_of = np.empty(len(costs), dtype=np.int64)
    slot_of = np.empty(len(costs), dtype=np.int64)
    for k in order.tolist():
        total, r = heapq.heappop(heap)
        rank_of[k], slot_of[k] = r, held[r]
        held[r] += 1
        if held[r] < micro_steps:
            heapq.heappush(heap, (total + float(costs[k]), r))
    return rank_of, slot_of


def _evaluate(cand: _Candidate, world: int, overhead: float, fsdp: bool) -> _Candidate:
    """Deal the candidate's micro-batches (``_deal``; with ghosts also ``_deal_by_rank``) and score it."""
    cand.rank_of, cand.slot_of, _ = _deal(cand.costs, world, cand.micro_steps, overhead)
    cand = _score(cand, world, overhead)
    if len(cand.costs) < world * cand.micro_steps:
        rank_of, slot_of = _deal_by_rank(cand.costs, world, cand.micro_steps)
        other = _score(dataclasses.replace(cand, rank_of=rank_of, slot_of=slot_of), world, overhead)
        cand = other if _better(cand, other, fsdp) else cand
    return cand


def _score(cand: _Candidate, world: int, overhead: float) -> _Candidate:
    """Set the candidate's slowest rank and its FSDP step time from where its micro-batches are."""
    m = cand.micro_steps
    totals = np.zeros(world)
    np.add.at(totals, cand.rank_of, cand.costs)
    slot_max = np.zeros(m)
    np.maximum.at(slot_max, cand.slot_of, cand.costs)
    cand.slowest = float(totals.max()) + m * overhead if m else 0.0
    cand.meet = float(slot_max.sum()) + m * overhead
    return cand


def _better(a: Optional[_Candidate], b: Optional[_Candidate], fsdp: bool) -> bool:
    """Whether ``b`` beats ``a``: the slowest rank, then the FSDP step time (the other way round with ``fsdp``),
    then fewer micro-steps."""
    if b is None:
        return False
    if a is None:
        return True
    key_a, key_b = (a.slowest, a.meet), (b.slowest, b.meet)
    if fsdp:
        key_a, key_b = key_a[::-1], key_b[::-1]
    for x, y in zip(key_a, key_b):
        if y < x - 1e-9:
            return True
        if y > x + 1e-9:
            return False
    return b.micro_steps < a.micro_steps


def _primary(cand: _Candidate, fsdp: bool) -> float:
    return cand.meet if fsdp else cand.slowest


def _emit(cand: Optional[_Candidate], world: int, oversize: np.ndarray, bound: float,
          group_cost, overhead: float) -> GlobalStepPlan:
    """The plan of the chosen candidate; ``group_cost(groups, planning costs)`` gives the micro-batches' costs
    exactly as ``cost.group_cost`` defines them (rank_costs add them up)."""
    if cand is None:  # every M up to one sample a micro-batch was tried, and that one always fits
        raise RuntimeError("plan_global_step found no plan for a step whose samples each fit the budget (a bug).")
    if cand.micro_steps == 0:
        return GlobalStepPlan([[] for _ in range(world)], oversize, np.zeros(world), bound)
    m = cand.micro_steps
    ranks: List[List[np.ndarray]] = [[_EMPTY] * m for _ in range(world)]
    for g, r, j in zip(cand.groups, cand.rank_of.tolist(), cand.slot_of.tolist()):
        ranks[r][j] = g
    totals = np.full(world, m * overhead)
    np.add.at(totals, cand.rank_of, np.asarray(group_cost(cand.groups, cand.costs), dtype=np.float64))  # in order
    return GlobalStepPlan(ranks, oversize, totals, bound)


def _bound(single: np.ndarray, n_groups_lb: float, world: int, overhead: float) -> float:
    """max(S / W, s_max) + M_lb x overhead (``plan_global_step``'s docstring)."""
    if len(single) == 0:
        return 0.0
    m_lb = -(-max(1, int(math.ceil(n_groups_lb - 1e-9))) // world)
    return float(max(single.sum() / world, single.max()) + m_lb * overhead)
