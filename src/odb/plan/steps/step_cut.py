"""One optimizer step's share of samples cut into micro-batches at the least cost (``global_batch_size``).

A step's samples are fixed (the user's), so the only choice is how to cut them into
micro-batches under the budget. Filling each micro-batch to the budget makes few micro-batches
but puts short samples beside long ones, and a padded batch costs B x its longest sample; many
small batches of similar lengths pad little but each micro-batch has a fixed cost of its own
(kernel launches, a forward and backward pass over the weights). The cut minimises their sum:

    sum over micro-batches of (batch cost + micro_batch_cost)

over cuts of the samples sorted by decreasing length into consecutive runs (a run's longest
sample is its first, so its cost is its size x its first sample's), each within the budget:
a shortest-path over the n + 1 cut points, O(n x the largest feasible run). Packed rows are
bin-packed as in a window (odb.plan.windows.packing): a row pads nothing.

Example:
    >>> import numpy as np
    >>> cost = CostModel((100,))
    >>> lengths = np.array([50, 48, 12, 10, 10, 9])
    >>> [g.tolist() for g in plan_step_share(lengths, np.arange(6), cost, overhead=0.0).groups]
    [[0], [1], [2], [3, 4], [5]]
    >>> [g.tolist() for g in plan_step_share(lengths, np.arange(6), cost, overhead=30.0).groups]
    [[0, 1], [2, 3, 4, 5]]
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.windows.planner import PoolPlan, SortedPool, plan_window


def least_cost_segments(pad_s: np.ndarray, counts: np.ndarray, cost: CostModel, overhead: float,
                        side: Optional[np.ndarray] = None) -> List[Tuple[int, int]]:
    """(start, stop) runs of the sorted padded lengths ``pad_s`` ((n, D), decreasing) that minimise the sum of
    their batch costs plus ``overhead`` each; ``counts[i]`` is the largest feasible run starting at i. Ties
    go to the larger run (fewer micro-batches). ``side``: the samples' side counts in that order
    (``odb.plan.costs.cost.split_side``; their side costs add to each run's cost), or None.

    Example:
        >>> cm = CostModel((100,))
        >>> least_cost_segments(np.array([[50], [10], [10]]), np.array([2, 2, 1]), cm, overhead=5.0)
        [(0, 1), (1, 3)]
    """
    n = len(pad_s)
    best = np.full(n + 1, np.inf)
    best[n] = 0.0
    nxt = np.zeros(n, dtype=np.int64)
    single_dim = pad_s.shape[1] == 1
    extra = cost.side_cost(side)
    cum_extra = None if extra is None else np.concatenate(([0.0], np.cumsum(extra)))
    for i in range(n - 1, -1, -1):
        k = int(min(counts[i], n - i))
        sizes = np.arange(1, k + 1)
        if cost.multiple > 1 and k >= cost.multiple:  # sizes a multiple of batch_size_multiple, or the rest
            sizes = sizes[(sizes % cost.multiple == 0) | (sizes == n - i)]
        if single_dim:  # the run's first sample is its longest: its cost is its size x that sample's
            run_cost = sizes * cost.batch_cost(pad_s[i:i + 1])
        else:
            run_cost = np.array([cost.batch_cost(pad_s[i:i + s]) for s in sizes])
        if cum_extra is not None:
            run_cost = run_cost + (cum_extra[i + sizes] - cum_extra[i])
        total = run_cost + overhead + best[i + sizes]
        pick = len(total) - 1 - int(np.argmin(total[::-1]))  # the largest run among the cheapest
        best[i], nxt[i] = total[pick], i + int(sizes[pick])
    out, i = [], 0
    while i < n:
        out.append((i, int(nxt[i])))
        i = int(nxt[i])
    return out


def plan_step_share(lengths: np.ndarray, ids: np.ndarray, cost: CostModel, overhead: float,
                    patches: Optional[np.ndarray] = None) -> PoolPlan:
    """Micro-batches of one step's samples (positions into ``lengths``), longest first; samples that alone
    exceed the budget are ``oversize``. Packed rows: the window's bin packing, everything emitted."""
    if cost.packed:
        return plan_window(lengths, ids, cost, final=True, patches=patches)
    pool = SortedPool.of(lengths, ids, cost, patches)
    runs = least_cost_segments(pool.padded, cost.max_counts_sorted(pool.padded, pool.patches), cost, overhead,
                               pool.patches)
    return PoolPlan([pool.order[s:e] for s, e in runs], np.empty(0, dtype=np.int64), pool.oversize)
