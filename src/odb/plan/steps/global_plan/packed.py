"""The packed layout's search: K = W x M rows filled longest processing time first (or best-fit rows
split up to K) for each candidate M, and local search on the slowest rank (``_plan_packed``)."""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import List, Optional

import numpy as np

from odb.plan.costs.cost import CostModel, split_side
from odb.plan.steps.global_plan.candidate import (_IMPROVE_STEPS, _MAX_TRIES, _better, _bound, _Candidate, _emit, _evaluate,
                                            _primary, _score)
from odb.plan.steps.global_plan.result import _EMPTY, GlobalStepPlan
from odb.plan.windows.packing import _pack, _sorted_sizes

_SMALL_ROWS = 512  # packed: up to this many rows the plan gets a local search


def _lpt_rows(weights: np.ndarray, rows: int, cap: float, max_items: Optional[int],
              counts: Optional[np.ndarray], max_patches: Optional[int], fill: Optional[np.ndarray] = None
              ) -> Optional[np.ndarray]:
    """Row of each item (given heaviest first), each to the least-loaded row (by ``weights``) that can take it
    (longest processing time first, in vectorised rounds): ``fill`` (default ``weights``) within
    ``cap``, at most ``max_items`` items and ``max_patches`` of the items' ``counts``; None when some item fits
    no row.

    Example:
        >>> _lpt_rows(np.array([6.0, 5.0, 4.0, 3.0, 2.0]), 2, 12.0, None, None, None).tolist()
        [0, 1, 1, 0, 0]
        >>> _lpt_rows(np.array([6.0, 5.0, 4.0, 3.0, 2.0]), 2, 10.0, None, None, None) is None  # best fit: 6+4, 5+3+2
        True
    """
    fill = weights if fill is None else fill
    n = len(weights)
    row_of = np.empty(n, dtype=np.int64)
    load = np.zeros(rows)  # what balances
    full = np.zeros(rows)  # what the cap bounds
    items = np.zeros(rows, dtype=np.int64)
    room = None if counts is None or max_patches is None else np.full(rows, float(max_patches))
    start = 0
    while start < n:
        # The rows lighter than the lightest one plus the next item each take one of the next items, heaviest
        # to lightest: the order in which one-at-a-time LPT would fill them (up to how the items shrink).
        by_load = np.argsort(load, kind="stable")
        ahead = int(np.searchsorted(load[by_load], load[by_load[0]] + weights[start], side="left"))
        chunk = np.arange(start, min(n, start + max(1, ahead)))
        target = by_load[:len(chunk)]
        start += len(chunk)
        ok = full[target] + fill[chunk] <= cap
        if max_items is not None:
            ok &= items[target] < max_items
        if room is not None:
            ok &= room[target] >= counts[chunk]
        took, rows_took = chunk[ok], target[ok]  # distinct rows within a round
        row_of[took] = rows_took
        load[rows_took] += weights[took]
        full[rows_took] += fill[took]
        items[rows_took] += 1
        if room is not None:
            room[rows_took] -= counts[took]
        for k in chunk[~ok].tolist():  # the least-loaded row that can still take it
            can = full + fill[k] <= cap
            if max_items is not None:
                can &= items < max_items
            if room is not None:
                can &= room >= counts[k]
            where = np.flatnonzero(can)
            if not len(where):
                return None
            r = int(where[np.argmin(load[where])])
            row_of[k] = r
            load[r] += weights[k]
            full[r] += fill[k]
            items[r] += 1
            if room is not None:
                room[r] -= counts[k]
    return row_of


def _split_rows(rows: List[np.ndarray], weight_of: np.ndarray, target: int) -> List[np.ndarray]:
    """Split the heaviest row holding two samples or more in two (LPT of its samples) until ``target`` rows."""
    rows = [r for r in rows]
    heap = [(-float(weight_of[r].sum()), k) for k, r in enumerate(rows)]
    heapq.heapify(heap)
    while len(rows) < target and heap:
        _, k = heapq.heappop(heap)
        row = rows[k]
        if len(row) < 2:
            continue
        w = weight_of[row]
        part = _lpt_rows(w, 2, math.inf, None, None, None)  # row is heaviest first already
        a, b = row[part == 0], row[part == 1]
        rows[k] = a
        rows.append(b)
        heapq.heappush(heap, (-float(weight_of[a].sum()), k))
        heapq.heappush(heap, (-float(weight_of[b].sum()), len(rows) - 1))
    return rows


def _plan_packed(lengths: np.ndarray, world: int, cost: CostModel, overhead: float,
                 side: Optional[np.ndarray], alone: bool, fsdp: Optional[bool],
                 max_micro_steps: Optional[int] = None) -> GlobalStepPlan:
    protect, fsdp = fsdp is not False, fsdp is True
    n_all = len(lengths)
    positions, fill, over = _sorted_sizes(lengths, np.arange(n_all), cost, side)  # fill: padded weights (budget)
    fixed = over if alone else _EMPTY
    oversize = _EMPTY if alone else over
    n, a = len(positions), len(fixed)
    # What a row costs (cost.group_cost): its samples' weights of their real lengths.
    weight_of = cost.sample_weights(lengths, side) if n_all else np.zeros(0)
    weights = weight_of[positions]
    fill_of = cost.sample_weights(cost.pad(lengths), side) if n_all else np.zeros(0)

    def group_cost(groups: List[np.ndarray], planned: np.ndarray) -> List[float]:
        if cost.integer_weights:  # sums of integer weights are exact: cost.group_cost's answer already
            return np.round(planned).tolist()
        return [float(cost.group_cost(lengths[g], None if side is None else side[g])) for g in groups]

    single = np.floor(np.concatenate((weights, weight_of[fixed])))
    max_items = None if cost.max_batch == np.iinfo(np.int64).max else int(cost.max_batch)
    rows_lb = float(fill.sum()) / cost.total_budget if n else 0.0
    if max_items is not None and n:
        rows_lb = max(rows_lb, n / max_items)
    bound = _bound(single, rows_lb + a, world, overhead)
    if n == 0 and a == 0:
        return GlobalStepPlan([[] for _ in range(world)], oversize, np.zeros(world), bound)
    counts = split_side(side)[0]
    counts = None if counts is None or cost.max_patches is None else counts[positions].astype(np.float64)
    fixed_groups = [np.array([u], dtype=np.int64) for u in fixed.tolist()]
    fixed_costs = weight_of[fixed]
    lb_total = max(float(single.sum()) / world, float(single.max()))

    def candidate(rows: List[np.ndarray], m: int, costs: Optional[np.ndarray] = None) -> _Candidate:
        if costs is None:
            costs = np.array([float(weight_of[r].sum()) for r in rows])
        return _evaluate(_Candidate(rows + fixed_groups, np.concatenate((costs, fixed_costs)), m), world, overhead,
                         fsdp)

    best: Optional[_Candidate] = None
    if n == 0:
        return _emit(candidate([], -(-a // world)), world, oversize, bound, group_cost, overhead)
    m = max(1, -(-(max(1, int(math.ceil(rows_lb - 1e-9))) + a) // world))
    bfd: Optional[List[np.ndarray]] = None
    misses = 0
    last = n + a if max_micro_steps is None else max(min(n + a, max_micro_steps), m)
    while m <= last:
        if best is not None and lb_total + m * overhead >= _primary(best, fsdp) - 1e-9:
            break
        k = world * m - a
        cand = None
        row_of = _lpt_rows(weights, k, cost.row_capacity, max_items, counts, cost.max_patches, fill) if k > 0 else None
        if row_of is not None:
            sort = np.argsort(row_of, kind="stable")
            bounds = np.flatnonzero(np.diff(row_of[sort])) + 1
            loads = np.bincount(row_of, weights=weights, minlength=k)
            cand = candidate(np.split(positions[sort], bounds), m, loads[np.unique(row_of)])
        elif k > 0:  # best-fit decreasing rows (odb.plan.windows.packing), split up to k rows
            bfd = _pack(positions, fill, cost, side) if bfd is None else bfd
            cand = candidate(_split_rows(bfd, weight_of, k), m) if len(bfd) <= k else None
        if cand is not None and world > 1 and len(cand.groups) <= _SMALL_ROWS:
            cand = _improve_packed(cand, weight_of, fill_of, world, overhead, protect, cost, side)
        if _better(best, cand, fsdp):
            best, misses = cand, 0
        elif cand is not None:
            misses += 1
        if misses >= _MAX_TRIES:
            break
        m += 1
    return _emit(best, world, oversize, bound, group_cost, overhead)


def _improve_packed(cand: _Candidate, weight_of: np.ndarray, fill_of: np.ndarray, world: int, overhead: float,
                    protect: bool, cost: CostModel, side: Optional[np.ndarray]) -> _Candidate:
    """Local search on the slowest rank of a packed plan (at most ``_IMPROVE_STEPS`` moves): move one sample of
    one of its rows holding several into another rank's row that can take it (budget, ``max_batch_size``, image
    patches), where that lowers the larger of the two ranks' totals below the old maximum; with ``protect`` no
    micro-step's costliest row gets costlier. Samples planned alone stay."""
    rows = [np.asarray(g) for g in cand.groups]
    k = len(rows)
    costs = cand.costs.copy()
    rank, slot = cand.rank_of.copy(), cand.slot_of.copy()
    full = np.array([float(fill_of[r].sum()) for r in rows])
    items = np.array([len(r) for r in rows])
    patches = split_side(side)[0]
    room = None if patches is None or cost.max_patches is None else \
        np.array([cost.max_patches - float(patches[r].sum()) for r in rows])
    movable = np.array([fill_of[r].max() <= cost.row_capacity for r in rows])  # a row over the budget is a fixed one
    totals = np.zeros(world)
    np.add.at(totals, rank, costs)
    for _ in range(_IMPROVE_STEPS):
        top = int(np.argmax(totals))
        worst = float(totals[top])
        slot_max = np.zeros(cand.micro_steps)
        np.maximum.at(slot_max, slot, costs)
        best_val, move = worst - 1e-9, None
        others = np.flatnonzero((rank != top) & movable)
        if not len(others):
            break
        for t in np.flatnonzero((rank == top) & (items > 1) & movable).tolist():
            xs = rows[t]  # every sample of the row against every other rank's row at once
            w, f = weight_of[xs][:, None], fill_of[xs][:, None]
            ok = full[others][None, :] + f <= cost.row_capacity
            if cost.max_batch != np.iinfo(np.int64).max:
                ok &= (items[others] < cost.max_batch)[None, :]
            if room is not None:
                ok &= room[others][None, :] >= patches[xs][:, None]
            if protect:
                ok &= costs[others][None, :] + w <= slot_max[slot[others]][None, :] + 1e-9
            val = np.where(ok, np.maximum(worst - w, totals[rank[others]][None, :] + w), np.inf)
            i = int(np.argmin(val))
            if val.flat[i] < best_val:
                best_val, move = float(val.flat[i]), (t, int(xs[i // len(others)]), int(others[i % len(others)]))
        if move is None:
            break
        t, x, u = move
        w, f = float(weight_of[x]), float(fill_of[x])
        rows[t] = rows[t][rows[t] != x]
        rows[u] = np.append(rows[u], x)
        for r, sign in ((t, -1.0), (u, 1.0)):
            costs[r] += sign * w
            full[r] += sign * f
            items[r] += int(sign)
            totals[rank[r]] += sign * w
            if room is not None:
                room[r] -= sign * patches[x]
    out = dataclasses.replace(cand, groups=rows, costs=costs, rank_of=rank, slot_of=slot)
    return _score(out, world, overhead)
