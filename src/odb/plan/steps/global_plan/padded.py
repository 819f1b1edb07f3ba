"""The padded layout's search: slot-by-slot cuts of the sorted samples for each candidate M, the last
micro-step cut to complement the ranks, the least-cost cut on small steps, and local search on the slowest
rank (``_plan_padded``)."""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import List, Optional, Tuple

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.steps.global_plan.candidate import (_IMPROVE_STEPS, _MAX_TRIES, _better, _bound, _Candidate, _deal, _emit,
                                            _evaluate, _primary, _score)
from odb.plan.steps.global_plan.result import _EMPTY, GlobalStepPlan
from odb.plan.steps.global_plan.runs import _Runs
from odb.plan.windows.planner import SortedPool
from odb.plan.steps.step_cut import least_cost_segments

_SMALL_STEP = 64  # up to this many samples the padded planner also tries the least-cost cut
_SMALL_WORLD = 32  # several dimensions or side costs: up to this many ranks the last micro-step is complemented


def _fill_by_splits(runs: List[Tuple[int, int]], costs: List[float], target: int, split
                    ) -> Tuple[List[Tuple[int, int]], List[float]]:
    """Split the costliest splittable run at its best cut until there are ``target`` runs (or none splits)."""
    runs, costs = list(runs), list(costs)
    heap = [(-c, s, e) for (s, e), c in zip(runs, costs)]
    heapq.heapify(heap)
    dead = set()
    while len(runs) - len(dead) < target and heap:
        neg, s, e = heapq.heappop(heap)
        cut = split(s, e)
        if cut is None:
            continue
        m, c1, c2 = cut
        dead.add((s, e))
        runs.extend([(s, m), (m, e)])
        costs.extend([c1, c2])
        heapq.heappush(heap, (-c1, s, m))
        heapq.heappush(heap, (-c2, m, e))
    keep = [k for k, r in enumerate(runs) if r not in dead]
    return [runs[k] for k in keep], [costs[k] for k in keep]


def _plan_padded(lengths: np.ndarray, world: int, cost: CostModel, overhead: float,
                 side: Optional[np.ndarray], alone: bool, fsdp: Optional[bool],
                 max_micro_steps: Optional[int] = None) -> GlobalStepPlan:
    protect, fsdp = fsdp is not False, fsdp is True
    n_all = len(lengths)
    pool = SortedPool.of(lengths, np.arange(n_all), cost, side)
    order, n = pool.order, len(pool.order)
    fixed = pool.oversize if alone else _EMPTY  # samples planned as micro-batches of their own
    oversize = _EMPTY if alone else pool.oversize

    def exact_costs(groups: List[np.ndarray]) -> List[float]:
        return [float(cost.group_cost(lengths[g], None if side is None else side[g])) for g in groups]

    def group_cost(groups: List[np.ndarray], planned: np.ndarray) -> List[float]:
        if runs_of is not None and runs_of.fast:  # B x the first sample's padded length: exact integers already
            return planned.tolist()
        return exact_costs(groups)

    fixed_groups = [np.array([u], dtype=np.int64) for u in fixed.tolist()]
    fixed_costs = exact_costs(fixed_groups)
    a = len(fixed_groups)
    extra = cost.side_cost(side)
    single_fixed = (cost.pad(lengths[fixed]).sum(axis=1)
                    + (0.0 if extra is None else np.floor(extra[fixed]))) if a else np.zeros(0)
    single_pool = (pool.padded.sum(axis=1) + (0.0 if extra is None else np.floor(extra[order]))) if n else np.zeros(0)
    fits = cost.copies_that_fit_unrounded(pool.padded) if n else np.ones(0)
    bound = _bound(np.concatenate((single_pool, single_fixed)).astype(np.float64),
                   float((1.0 / np.maximum(fits, 1)).sum()) + a, world, overhead)
    runs_of = _Runs(pool, cost) if n else None
    if n == 0 and a == 0:
        return GlobalStepPlan([[] for _ in range(world)], oversize, np.zeros(world), bound)
    lb_total = max(float(np.concatenate((single_pool, single_fixed)).sum()) / world,
                   float(np.concatenate((single_pool, single_fixed)).max()))

    fixed_cost_array = np.array(fixed_costs, dtype=np.float64)

    def candidate(starts: np.ndarray, ends: np.ndarray, m: int, costs: Optional[np.ndarray] = None) -> _Candidate:
        """The runs [starts, ends) (``costs``: theirs, when known), split up to W x m of them with the samples
        planned alone (``_fill_by_splits``), in sample order, dealt and scored (its groups come at ``_emit``)."""
        if costs is None:
            costs = runs_of.cost(starts, ends) if len(starts) else np.zeros(0)
        if 0 < len(starts) < world * m - a:
            runs, split_costs = _fill_by_splits(list(zip(starts.tolist(), ends.tolist())), costs.tolist(),
                                                world * m - a, runs_of.split)
            starts, ends = np.array(runs, dtype=np.int64).T
            costs = np.array(split_costs, dtype=np.float64)
        if len(starts) > 1 and not (starts[1:] > starts[:-1]).all():  # in sample order: not dependent on split order
            by_start = np.argsort(starts, kind="stable")
            starts, ends, costs = starts[by_start], ends[by_start], costs[by_start]
        cand = _Candidate(None, np.concatenate((costs, fixed_cost_array)), m,
                          runs=np.stack((starts, ends), axis=1))
        return _evaluate(cand, world, overhead, fsdp)

    def complemented(starts: np.ndarray, ends: np.ndarray, costs: np.ndarray, last_start: int, m: int,
                     limit: float) -> Optional[_Candidate]:
        """The runs (in sample order, ``costs`` theirs) before ``last_start`` dealt over m - 1 micro-steps, then the
        last micro-step cut to even out the ranks' totals (``_Runs.complement``), none of its runs costlier than
        the costliest of the plain cut's last micro-step (FSDP waits for it)."""
        h = int(np.searchsorted(starts, last_start))
        if h == len(starts) or h + a != world * (m - 1):
            return None
        run_cap = float(costs[h:].max()) if protect else math.inf
        head_costs = np.concatenate((costs[:h], fixed_cost_array))
        rank_of, slot_of, totals = _deal(head_costs, world, m - 1, 0.0)
        last = runs_of.complement(last_start, totals, limit - m * overhead, run_cap)
        if last is None:
            return None
        tail, ranks = last
        tail = np.array(tail, dtype=np.int64)
        tail_costs = runs_of.cost(tail[:, 0], tail[:, 1])
        cand = _Candidate(None, np.concatenate((costs[:h], tail_costs, fixed_cost_array)), m,
                          np.concatenate((rank_of[:h], ranks, rank_of[h:])),
                          np.concatenate((slot_of[:h], np.full(world, m - 1), slot_of[h:])),
                          runs=np.concatenate((np.stack((starts[:h], ends[:h]), axis=1), tail)))
        return _score(cand, world, overhead)

    def polish(cand: _Candidate) -> _Candidate:
        """The candidate after ``_improve``."""
        if world == 1 or (cand.micro_steps == 1 and len(cand.costs) == world):
            return cand  # one micro-batch per rank: the min-max cut is as good as moves get
        return _improve(cand, runs_of, world, overhead, protect)

    best: Optional[_Candidate] = None
    if n == 0:
        m = -(-a // world)
        best = candidate(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), m)
    else:
        min_runs = int(runs_of.count(0, math.inf, n))
        m0 = max(1, -(-(min_runs + a) // world))
        m_max = max(m0, n + a)  # past ceil((n + a) / W) some ranks run ghosts: a few M more, while they may win
        if max_micro_steps is not None:
            m_max = max(m0, min(m_max, max_micro_steps))
        misses, first_cap, first_runs = 0, None, 0
        for m in range(m0, m_max + 1):
            if best is not None and lb_total + m * overhead >= _primary(best, fsdp) - 1e-9:
                break
            sizes = _slot_sizes(world, m, a)
            cut, cap = runs_of.slot_cut(sizes, first_cap if sum(sizes) >= first_runs else None)
            if cap is not None:  # all the samples fit sum(sizes) runs under it: so they fit more
                first_cap, first_runs = cap, sum(sizes)
            if cut is None:
                continue
            starts, ends, last_start = cut
            costs = runs_of.cost(starts, ends)
            cand = candidate(starts, ends, m, costs)
            if m > 1 and sizes[-1] == world and (runs_of.fast or world <= _SMALL_WORLD):
                other = complemented(starts, ends, costs, last_start, m, cand.slowest)
                cand = other if _better(cand, other, fsdp) else cand
            cand = polish(cand)
            if _better(best, cand, fsdp):
                best, misses = cand, 0
            else:
                misses += 1
                if misses >= _MAX_TRIES:
                    break
        if world == 1 or n <= _SMALL_STEP:  # the least-cost cut of odb.plan.steps.step_cut, dealt
            for scale in ((1.0,) if world == 1 else (1.0, 0.5, 0.0)):
                runs = least_cost_segments(pool.padded, runs_of.cnt, cost, overhead * scale, pool.patches)
                m = max(1, -(-(len(runs) + a) // world))
                if max_micro_steps is not None and m > max_micro_steps and best is not None:
                    continue
                cand = polish(candidate(np.array([s for s, _ in runs], dtype=np.int64),
                                        np.array([e for _, e in runs], dtype=np.int64), m))
                if _better(best, cand, fsdp):
                    best = cand
    if best is not None:  # the chosen candidate's groups: its runs of the sorted samples, then those planned alone
        best = dataclasses.replace(best, groups=[order[s:e] for s, e in best.runs.tolist()] + fixed_groups)
    return _emit(best, world, oversize, bound, group_cost, overhead)


def _improve(cand: _Candidate, runs_of: _Runs, world: int, overhead: float, protect: bool) -> _Candidate:
    """Local search on the slowest rank (at most ``_IMPROVE_STEPS`` moves, each strictly lowering it below
    the old maximum): move samples from one of its runs to the neighbouring run (in the sorted order) of the same
    or another rank, swap one of its runs with a cheaper one of the same micro-step on another rank, or hand a
    run to a ghost of another rank (of the same micro-step if it has one). Every run keeps a sample (no ghost
    appears) and stays feasible; with ``protect`` no micro-step's costliest micro-batch gets costlier (FSDP
    waits for it)."""
    runs = cand.runs.copy()
    nr = len(runs)
    costs = cand.costs.copy()
    rank = cand.rank_of.copy()
    slot = cand.slot_of.copy()
    totals = np.zeros(world)
    np.add.at(totals, rank, costs)
    slot_max = np.zeros(cand.micro_steps)
    np.maximum.at(slot_max, slot, costs)
    ghosts = len(costs) < world * cand.micro_steps
    occupied = np.zeros((world, cand.micro_steps), dtype=bool)
    occupied[rank, slot] = True
    members = _by_slot(slot, cand.micro_steps)
    for _ in range(_IMPROVE_STEPS):
        top = int(np.argmax(totals))
        worst = float(totals[top])
        best_val, move = worst - 1e-9, None
        for t in np.flatnonzero(rank[:nr] == top).tolist():
            s, e = runs[t]
            for nb in (t - 1, t + 1):  # give samples to a neighbour run
                if nb < 0 or nb >= nr or e - s < 2:
                    continue
                q = int(rank[nb])
                ns, ne = runs[nb]
                if _shift_hopeless(runs_of, (int(s), int(e)), (int(ns), int(ne)), nb < t,
                                   float(slot_max[slot[nb]]) if protect else math.inf,
                                   float(totals[q]) - float(costs[nb]) if q != top else None, best_val):
                    continue
                k = np.arange(1, e - s)
                if nb < t:  # our first k samples join the end of the run before
                    a_s, a_e, b_s, b_e = s + k, np.full(len(k), e), np.full(len(k), ns), s + k
                else:  # our last k samples join the start of the run after
                    a_s, a_e, b_s, b_e = np.full(len(k), s), e - k, e - k, np.full(len(k), ne)
                ok = runs_of.valid(a_s, a_e) & runs_of.valid(b_s, b_e)
                if not ok.any():
                    continue
                k = k[ok]
                a_c = runs_of.cost(a_s[ok], a_e[ok])
                b_c = runs_of.cost(b_s[ok], b_e[ok])
                keep = b_c <= (slot_max[slot[nb]] if protect else math.inf) + 1e-9  # no micro-step gets costlier
                if not keep.any():
                    continue
                k, a_c, b_c = k[keep], a_c[keep], b_c[keep]
                mine = worst - costs[t] + a_c
                theirs = totals[q] - costs[nb] + b_c
                val = np.maximum(mine, theirs) if q != top else mine + b_c - costs[nb]
                i = int(np.argmin(val))
                if val[i] < best_val:
                    best_val = float(val[i])
                    move = ("shift", t, nb, int(k[i]), float(a_c[i]), float(b_c[i]))
            peers = members[slot[t]]
            peers = peers[rank[peers] != top]
            if len(peers):  # swap with a cheaper run of the same micro-step
                gain = costs[t] - costs[peers]
                val = np.where(gain > 0, np.maximum(worst - gain, totals[rank[peers]] + gain), np.inf)
                i = int(np.argmin(val))
                if val[i] < best_val:
                    best_val, move = float(val[i]), ("swap", t, int(peers[i]))
            if ghosts:  # hand the run to a ghost of another rank (its own micro-step's first; with ``protect`` only
                free = ~occupied  # a micro-step it does not make costlier)
                free[top] = False
                if protect:
                    free &= (slot_max >= costs[t] - 1e-9)[None, :]
                ranks_free = np.flatnonzero(free.any(axis=1))
                if len(ranks_free):
                    q = int(ranks_free[np.argmin(totals[ranks_free])])
                    val = max(worst - costs[t], totals[q] + costs[t])
                    if val < best_val:
                        j = int(slot[t]) if free[q, slot[t]] else int(np.argmax(free[q]))
                        best_val, move = val, ("hand", t, q, j)
        if move is None:
            break
        if move[0] == "hand":
            _, t, q, j = move
            occupied[rank[t], slot[t]] = False
            occupied[q, j] = True
            totals[rank[t]] -= costs[t]
            totals[q] += costs[t]
            rank[t], slot[t] = q, j
            members = _by_slot(slot, cand.micro_steps)
            slot_max[:] = 0.0
            np.maximum.at(slot_max, slot, costs)
        elif move[0] == "swap":
            _, t, u = move
            rt, ru = int(rank[t]), int(rank[u])
            totals[rt] += costs[u] - costs[t]
            totals[ru] += costs[t] - costs[u]
            rank[t], rank[u] = ru, rt
        else:
            _, t, nb, k, a_c, b_c = move
            (s, e), (ns, ne) = runs[t], runs[nb]
            runs[t], runs[nb] = ((s + k, e), (ns, s + k)) if nb < t else ((s, e - k), (e - k, ne))
            totals[rank[t]] += a_c - costs[t]
            totals[rank[nb]] += b_c - costs[nb]
            costs[t], costs[nb] = a_c, b_c
            slot_max[:] = 0.0
            np.maximum.at(slot_max, slot, costs)
    cand = dataclasses.replace(cand, costs=costs, rank_of=rank, slot_of=slot, runs=runs)
    return _score(cand, world, overhead)


def _by_slot(slot: np.ndarray, micro_steps: int) -> List[np.ndarray]:
    """The micro-batches of each micro-step, in index order."""
    order = np.argsort(slot, kind="stable")
    return np.split(order, np.searchsorted(slot[order], np.arange(1, micro_steps)))


def _shift_hopeless(runs_of: _Runs, mine: Tuple[int, int], theirs: Tuple[int, int], before: bool, run_cap: float,
                    rest: Optional[float], best: float) -> bool:
    """Whether no shift of samples from run ``mine`` to its neighbour ``theirs`` (the run ``before`` it, or after)
    can be taken: the neighbour's run only gets costlier as it takes more, so if taking one sample already makes
    it costlier than ``run_cap``, or (``rest``: the neighbour rank's total less that run, when it is another rank)
    its rank's total no less than ``best``, no larger shift does better."""
    (s, e), (ns, ne) = mine, theirs
    if (s + 1 - ns if before else ne - e + 1) > runs_of.longest_run:  # beyond what ``cost_of`` prices: try them
        return False
    one = runs_of.cost_of(ns, s + 1) if before else runs_of.cost_of(e - 1, ne)
    return one > run_cap + 1e-9 or (rest is not None and rest + one >= best)


def _slot_sizes(world: int, micro_steps: int, fixed: int) -> List[int]:
    """Runs per micro-step for the cut: W each, less the micro-batches of samples planned alone (which, the
    costliest, are dealt first)."""
    sizes = [world] * micro_steps
    j = 0
    while fixed > 0 and j < micro_steps:
        take = min(fixed, sizes[j])
        sizes[j] -= take
        fixed -= take
        j += 1
    return [s for s in sizes if s > 0] or [0]
