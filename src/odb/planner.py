"""The online planner: a pure function from a pool of sample lengths to batches.

The pool (samples carried from the last window plus a new window) is sorted by
decreasing size. A batch is a run of neighbours in that order. A dynamic program
picks the runs to emit now: a run is worth emitting when its real tokens reach
``pack_efficiency`` of a *full* batch of copies of its longest sample; what no good
run takes is carried to the next window, where more neighbours of similar length
arrive. When the carry would exceed its limit, the best-packed runs among the
carried samples are emitted until it fits. The last window of the data is cut
greedily (fewest batches). Everything here is integers in, index arrays out.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import numpy as np

from .cost import CostModel


@dataclasses.dataclass(frozen=True)
class WindowPlan:
    """The planner's answer for one pool.

    groups: positions into the pool, one array per batch, longest batch first.
    carry: positions to carry into the next window.
    oversize: positions of samples that alone exceed the budget (left to the policy).
    """

    groups: List[np.ndarray]
    carry: np.ndarray
    oversize: np.ndarray


_TIE = 1e-6  # tokens; absorbs float error where emitting and carrying tie


def sort_order(padded: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Decreasing total padded length; ties broken by sample id (deterministic)."""
    return np.lexsort((ids, -padded.sum(axis=1)))


def greedy_segments(counts: np.ndarray, multiple: int) -> List[tuple]:
    """Cut a sorted run greedily: each batch takes as many samples as fit."""
    segs, i, n = [], 0, len(counts)
    while i < n:
        b = int(counts[i])
        if b >= multiple:
            b -= b % multiple
        b = max(b, 1)
        segs.append((i, i + b))
        i += b
    return segs


def _dp_segments(tokens: np.ndarray, counts: np.ndarray, ideal: np.ndarray, efficiency: float,
                 multiple: int) -> List[tuple]:
    """Choose disjoint runs maximising sum(tokens / efficiency - ideal); others are carried."""
    n = len(tokens)
    cum = np.concatenate(([0.0], np.cumsum(tokens, dtype=np.float64)))
    scale = 1.0 / efficiency
    best = np.zeros(n + 1)
    take = np.zeros(n, dtype=np.int64)
    for i in range(n - 1, -1, -1):
        best[i] = best[i + 1]
        b_max = int(counts[i])
        if b_max <= 0:
            continue
        if multiple == 1 or b_max < multiple:
            sizes = np.arange(1, b_max + 1)
            vals = scale * (cum[i + 1:i + b_max + 1] - cum[i]) - ideal[i] + best[i + 1:i + b_max + 1]
        else:
            sizes = np.arange(multiple, b_max + 1, multiple)
            vals = scale * (cum[i + sizes] - cum[i]) - ideal[i] + best[i + sizes]
        k = int(np.argmax(vals))
        if vals[k] >= best[i] - _TIE:  # a run that just reaches pack_efficiency is emitted
            best[i] = vals[k]
            take[i] = sizes[k]
    segs, i = [], 0
    while i < n:
        if take[i]:
            segs.append((i, i + int(take[i])))
            i += int(take[i])
        else:
            i += 1
    return segs


def plan_window(
    lengths: np.ndarray,
    ids: np.ndarray,
    cost: CostModel,
    *,
    final: bool,
    pack_efficiency: float = 0.95,
    carry_limit: int = 512,
    patches: Optional[np.ndarray] = None,
) -> WindowPlan:
    """Plan one pool of samples.

    Args:
        lengths: (n, D) or (n,) real lengths of the pooled samples.
        ids: (n,) distinct sample ids, used only to break ties deterministically.
        cost: the cost model.
        final: the data has ended: emit everything (no carry).
        pack_efficiency: emit a run when its tokens reach this share of a full batch.
        carry_limit: the most samples carried to the next window.
        patches: (n,) image patches per sample, when a patch cap is set.

    Example:
        >>> import numpy as np
        >>> cm = CostModel((100,))
        >>> plan = plan_window(np.array([50, 50, 10, 10]), np.arange(4), cm, final=True)
        >>> [g.tolist() for g in plan.groups]
        [[0, 1], [2, 3]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim == 1:
        lengths = lengths[:, None]
    ids = np.asarray(ids)
    cost.check_dims(lengths.shape[1])
    padded = cost.pad(lengths)
    fits = cost.copies_that_fit(padded, patches)
    oversize = np.flatnonzero(fits == 0)
    ok = np.flatnonzero(fits > 0)
    if len(ok) == 0:
        return WindowPlan([], np.empty(0, dtype=np.int64), oversize)
    order = ok[sort_order(padded[ok], ids[ok])]
    pad_s = padded[order]
    patch_s = None if patches is None else np.asarray(patches)[order]
    counts = cost.max_counts_sorted(pad_s, patch_s)
    if final:
        runs = [np.arange(s, e) for s, e in greedy_segments(counts, cost.multiple)]
    else:
        tokens = lengths[order].sum(axis=1).astype(np.float64)
        ideal = fits[order] * pad_s.sum(axis=1).astype(np.float64)
        runs = [np.arange(s, e) for s, e in _dp_segments(tokens, counts, ideal, pack_efficiency, cost.multiple)]
        runs += _drain_carry(runs, tokens, ideal, pad_s, patch_s, cost, carry_limit)
    taken = np.zeros(len(order), dtype=bool)
    for r in runs:
        taken[r] = True
    runs.sort(key=lambda r: int(r[0]))
    return WindowPlan([order[r] for r in runs], order[~taken], oversize)


def _drain_carry(runs: List[np.ndarray], tokens: np.ndarray, ideal: np.ndarray, pad_s: np.ndarray,
                 patch_s: Optional[np.ndarray], cost: CostModel, carry_limit: int) -> List[np.ndarray]:
    """Runs of carried samples to emit, best packed first, until at most carry_limit remain."""
    taken = np.zeros(len(tokens), dtype=bool)
    for r in runs:
        taken[r] = True
    carried = np.flatnonzero(~taken)
    excess = len(carried) - carry_limit
    if excess <= 0:
        return []
    sub_patches = None if patch_s is None else patch_s[carried]
    sub_counts = cost.max_counts_sorted(pad_s[carried], sub_patches)
    cut = greedy_segments(sub_counts, cost.multiple)
    quality = np.array([tokens[carried[s:e]].sum() / max(ideal[carried[s]], 1.0) for s, e in cut])
    extra = []
    for k in np.argsort(-quality, kind="stable"):
        if excess <= 0:
            break
        s, e = cut[k]
        extra.append(carried[s:e])
        excess -= e - s
    return extra


def balanced_partition(lengths: np.ndarray, ids: np.ndarray, cost: CostModel, n_groups: int,
                       patches: Optional[np.ndarray] = None) -> List[np.ndarray]:
    """Cut a pool into at most ``n_groups`` runs whose costliest run is as cheap as possible.

    Used for the last window of a rank that must fill a given number of steps: instead
    of full batches and a few tiny ones, every step gets a similar share. Returns
    positions into the pool, longest run first.

    Example:
        >>> groups = balanced_partition(np.array([8, 8, 8, 8]), np.arange(4), CostModel((32,)), 2)
        >>> [len(g) for g in groups]
        [2, 2]
    """
    lengths = np.asarray(lengths, dtype=np.int64).reshape(len(ids), -1)
    if len(lengths) == 0 or n_groups <= 0:
        return []
    padded = cost.pad(lengths)
    order = sort_order(padded, np.asarray(ids))
    pad_s = padded[order]
    patch_s = None if patches is None else np.asarray(patches)[order]

    def cut(scale: float) -> List[tuple]:
        return greedy_segments(cost.scaled(scale).max_counts_sorted(pad_s, patch_s), cost.multiple)

    best = cut(1.0)
    if len(best) <= n_groups:
        lo, hi = 0.0, 1.0
        for _ in range(20):
            mid = (lo + hi) / 2
            segs = cut(mid)
            if len(segs) <= n_groups:
                hi, best = mid, segs
            else:
                lo = mid
    return [order[s:e] for s, e in best]
