"""The planner of the packed layout: rows packed close to the budget, online, with carry.

In the packed layout (``ODBConfig(layout="packed")``) a batch is one padding-free row
and costs the sum of its samples' weights (``CostModel.sample_weights``). Planning a
pool (the samples carried from the last window plus a new window) is bin packing:

1. The pool is sorted by decreasing weight, ties broken by sample id (so the answer
   does not depend on arrival order inside the window).
2. Best-fit decreasing: each sample goes into the open row it fills most tightly,
   or opens a row (``best_fit_decreasing``).
3. A row is emitted when its cost reaches ``pack_efficiency`` of the budget (or it
   holds ``max_batch_size`` samples, or its image patches reach that share of
   ``max_image_patches``): it cannot get much fuller. The other rows' samples are
   carried to the next window, where more samples arrive to fill the gaps.
4. When more than ``carry_limit`` samples would be carried, the fullest carried rows
   are emitted until the carry fits.
5. The last window of the data is packed whole (nothing carried).

Samples whose weight alone exceeds the budget are returned as oversize (the loader's
``oversize`` policy decides). Everything here is integers in, index arrays out.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import List, Optional, Sequence

import numpy as np

from odb.plan.costs.cost import CostModel, split_side
from odb.plan.windows.pool_plan import PoolPlan


def best_fit_decreasing(sizes: Sequence[float], capacity: float, max_items: Optional[int] = None,
                        patches: Optional[Sequence[int]] = None, max_patches: Optional[int] = None
                        ) -> List[List[int]]:
    """Pack items, given in decreasing size, into rows: each into the open row it fills most tightly.

    Returns the rows as lists of item positions, in the order they were opened. A row
    holds at most ``max_items`` items and ``max_patches`` patches (when given). Every
    item must fit an empty row on its own.

    Example:
        >>> best_fit_decreasing([6, 5, 4, 3, 2], 10)
        [[0, 2], [1, 3, 4]]
    """
    max_items = len(sizes) if max_items is None else max_items
    free: List[float] = []  # remaining capacity of the open rows, ascending
    owner: List[int] = []  # the row of each entry of ``free``
    rows: List[List[int]] = []
    room: List[float] = []  # patches each row can still take
    for k, size in enumerate(sizes):
        j = bisect_left(free, size)
        if patches is not None and max_patches is not None:
            while j < len(free) and room[owner[j]] < patches[k]:
                j += 1
        if j < len(free):
            row = owner[j]
            left = free[j] - size
            del free[j], owner[j]
            rows[row].append(k)
        else:
            row = len(rows)
            rows.append([k])
            room.append(float(max_patches) if max_patches is not None else 0.0)
            left = capacity - size
        if patches is not None and max_patches is not None:
            room[row] -= patches[k]
        if len(rows[row]) < max_items:
            at = bisect_left(free, left)
            free.insert(at, left)
            owner.insert(at, row)
    return rows


def _sorted_sizes(lengths: np.ndarray, ids: np.ndarray, cost: CostModel, patches: Optional[np.ndarray]):
    """(positions that fit, in decreasing weight then id; their weights; positions that do not fit)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim == 1:
        lengths = lengths[:, None]
    cost.check_dims(lengths.shape[1])
    padded = cost.pad(lengths)
    fits = cost.copies_that_fit(padded, patches)
    ok = np.flatnonzero(fits > 0)
    weights = cost.sample_weights(padded[ok], None if patches is None else patches[ok]) if len(ok) else np.zeros(0)
    order = np.lexsort((np.asarray(ids)[ok], -weights))
    return ok[order], weights[order], np.flatnonzero(fits == 0)


def _pack(positions: np.ndarray, weights: np.ndarray, cost: CostModel, patches: Optional[np.ndarray],
          share: float = 1.0) -> List[np.ndarray]:
    """Best-fit decreasing of sorted samples into rows of ``share`` x the budget."""
    exact = cost.integer_weights  # integer weights: pack with Python ints, exactly
    sizes = weights.astype(np.int64).tolist() if exact else weights.tolist()
    cap = int(cost.total_budget * share) if exact else cost.row_capacity * share
    counts = split_side(patches)[0]
    patch_list = None if counts is None or cost.max_patches is None else counts[positions].tolist()
    max_items = None if cost.max_batch == np.iinfo(np.int64).max else int(cost.max_batch)
    rows = best_fit_decreasing(sizes, cap, max_items, patch_list, cost.max_patches)
    return [positions[np.asarray(r, dtype=np.int64)] for r in rows]


def plan_packed_window(lengths: np.ndarray, ids: np.ndarray, cost: CostModel, *, final: bool,
                       pack_efficiency: float = 0.95, carry_limit: int = 512,
                       patches: Optional[np.ndarray] = None) -> PoolPlan:
    """Plan one pool in the packed layout (the arguments of ``odb.plan.windows.planner.plan_window``).

    Example:
        >>> cm = CostModel((100,), layout="packed")
        >>> plan = plan_packed_window(np.array([60, 40, 50, 20]), np.arange(4), cm, final=False)
        >>> [g.tolist() for g in plan.groups], plan.carry.tolist()   # the row 50 + 20 waits for more samples
        ([[0, 1]], [2, 3])
    """
    ids = np.asarray(ids)
    patches = None if patches is None else np.asarray(patches)
    positions, weights, oversize = _sorted_sizes(lengths, ids, cost, patches)
    rows = _pack(positions, weights, cost, patches)
    if final:
        return PoolPlan(rows, np.empty(0, dtype=np.int64), oversize)
    weight_of = np.zeros(len(ids))
    weight_of[positions] = weights
    fill = np.array([_fill(r, weight_of, cost, patches) for r in rows])
    full = fill >= pack_efficiency - 1e-12
    if cost.max_batch != np.iinfo(np.int64).max:
        full |= np.array([len(r) >= cost.max_batch for r in rows], dtype=bool)
    carried = sum(len(r) for r, f in zip(rows, full) if not f)
    for k in np.argsort(-fill, kind="stable"):  # the carry would grow too large: emit its fullest rows
        if carried <= carry_limit:
            break
        if not full[k]:
            full[k] = True
            carried -= len(rows[k])
    emitted = [r for r, f in zip(rows, full) if f]
    rest = [r for r, f in zip(rows, full) if not f]
    carry = np.concatenate(rest) if rest else np.empty(0, dtype=np.int64)
    return PoolPlan(emitted, carry, oversize)


def _fill(row: np.ndarray, weight_of: np.ndarray, cost: CostModel, patches: Optional[np.ndarray]) -> float:
    """The share of the budget a row uses (of the patch cap, when that is the fuller one)."""
    fill = float(weight_of[row].sum()) / cost.total_budget
    counts = split_side(patches)[0]
    if counts is not None and cost.max_patches is not None:
        fill = max(fill, float(counts[row].sum()) / cost.max_patches)
    return fill


def balanced_rows(lengths: np.ndarray, ids: np.ndarray, cost: CostModel, n_groups: int,
                  patches: Optional[np.ndarray] = None) -> List[np.ndarray]:
    """Pack a pool into at most ``n_groups`` rows whose costliest row is as cheap as possible.

    The packed counterpart of ``odb.plan.windows.planner.balanced_partition`` (a rank's last window
    spread over the steps it must fill): best-fit decreasing under the smallest share
    of the budget that still needs no more than ``n_groups`` rows (bisection).

    Example:
        >>> rows = balanced_rows(np.array([8, 8, 8, 8]), np.arange(4), CostModel((32,), layout="packed"), 2)
        >>> [len(r) for r in rows]
        [2, 2]
    """
    if len(ids) == 0 or n_groups <= 0:
        return []
    patches = None if patches is None else np.asarray(patches)
    positions, weights, oversize = _sorted_sizes(lengths, ids, cost, patches)
    best = _pack(positions, weights, cost, patches)
    if len(best) <= n_groups and len(positions):
        lo, hi = float(weights[0]) / cost.total_budget, 1.0  # no row is cheaper than its largest sample
        for _ in range(20):
            mid = (lo + hi) / 2
            rows = _pack(positions, weights, cost, patches, mid)
            if len(rows) <= n_groups:
                hi, best = mid, rows
            else:
                lo = mid
    return best + [np.array([k]) for k in oversize.tolist()]
