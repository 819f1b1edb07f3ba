"""The online planner: a pure function from a pool of sample lengths to batches.

The pool (samples carried from the last window plus a new window) is sorted by
decreasing size (with several length dimensions, in bands of size by how the dimensions
split it: ``sort_order``). A batch is a run of neighbours in that order. A dynamic program
picks the runs to emit now: a run is worth emitting when its real tokens reach
``pack_efficiency`` of a *full* batch of copies of its longest sample; what no good
run takes is carried to the next window, where more neighbours of similar length
arrive. When the carry would exceed its limit, the best-packed runs among the
carried samples are emitted until it fits. The last window of the data is cut
greedily (fewest batches). Everything here is integers in, index arrays out.
In the packed layout (one padding-free row per batch) both entry points hand over to
``odb.plan.windows.packing``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from typing import List, Optional

import numpy as np

from odb.plan.costs.cost import CostModel, split_side
from odb.plan.windows.packing import balanced_rows, plan_packed_window
from odb.plan.windows.pool_plan import PoolPlan


_TIE = 1e-6  # tokens; absorbs float error where emitting and carrying tie
_BANDS_PER_OCTAVE = 4  # several length dimensions: bands of total length, 2**(1/4) = 1.19 wide
# Integer lower edges of the bands, ceil(2**(k / 4)): a total's band is exact integer arithmetic.
_BAND_EDGES = np.unique(np.ceil(2.0 ** (np.arange(0, 63 * _BANDS_PER_OCTAVE) / _BANDS_PER_OCTAVE))).astype(np.int64)


def sort_order(padded: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """The planner's order: neighbours in it make well-packed batches. Ties broken by sample id.

    One dimension: decreasing padded length. Several (e.g. source and target): a batch
    pays for the longest of each dimension, so samples of equal total that split it
    differently pack badly. The order goes down bands of total length (each 1.19x wide),
    and inside a band by the first dimension's share of the total, up and down in
    alternate bands so that a run crossing into the next band meets a similar split;
    then by decreasing total. On the benchmark's two-length workloads this makes 7-8% fewer
    steps than sorting by the total alone (docs/algorithm.md).

    Example:
        >>> sort_order(np.array([[3], [9], [5]]), np.arange(3)).tolist()
        [1, 2, 0]
        >>> sort_order(np.array([[10, 30], [30, 10], [20, 20], [11, 30]]), np.arange(4)).tolist()
        [0, 3, 2, 1]
    """
    total = padded.sum(axis=1)
    if padded.shape[1] == 1:
        return np.lexsort((ids, -total))
    band = np.searchsorted(_BAND_EDGES, np.maximum(total, 1), side="right")
    share = padded[:, 0] / np.maximum(total, 1)
    share = np.where(band % 2 == 0, share, -share)
    return np.lexsort((ids, -total, -share, -band))


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


def _max_counts_sorted(cost: CostModel, padded: np.ndarray, patches: Optional[np.ndarray]) -> np.ndarray:
    """The counts of ``cost.max_counts_sorted``, fast with several length dimensions too.

    ``patches``: the samples' side counts (``odb.plan.costs.cost.split_side``), or None. With one
    dimension and no side costs CostModel's answer is vectorised already. With several (or side
    costs, which sum over a run) it scans
    the running maxima from every start in Python, O(n x batch size). A run that does
    not fit stays unfit as it grows, so a binary search on the run length, for all
    starts at once, asks CostModel's own feasibility test of range maxima read from a
    sparse table: O(n log n) numpy work. tests/plan/test_planner.py checks the two agree.

    Example:
        >>> _max_counts_sorted(CostModel((100,)), np.array([[40, 10], [10, 40], [20, 20], [5, 5]]), None).tolist()
        [1, 1, 2, 1]
    """
    n, dims = padded.shape
    side, (patches, _) = patches, split_side(patches)
    extra = cost.side_cost(side)
    if (dims == 1 and extra is None) or n == 0:
        return cost.max_counts_sorted(padded, side)
    cum_extra = None if extra is None else np.concatenate(([0.0], np.cumsum(extra)))
    w = cost.token_weight(padded)
    lo = np.zeros(n, dtype=np.int64)  # a run this long fits
    hi = np.minimum(cost.copies_that_fit_unrounded(padded), np.arange(n, 0, -1))  # none longer fits
    if patches is not None and cost.max_patches is not None:
        cum = np.concatenate(([0], np.cumsum(patches)))
        by_patch = np.searchsorted(cum, cum[:-1] + cost.max_patches, side="right") - 1 - np.arange(n)
        hi = np.minimum(hi, by_patch)
    # levels[l, i] = max of w[i : i + 2**l] (cut at n): two overlapping levels cover any run.
    levels = [w]
    while (1 << len(levels)) <= hi.max():
        half = 1 << (len(levels) - 1)
        nxt = levels[-1].copy()
        nxt[:n - half] = np.maximum(nxt[:n - half], nxt[half:])
        levels.append(nxt)
    table = np.stack(levels)
    active = np.flatnonzero(lo < hi)
    while len(active):
        a_lo, a_hi = lo[active], hi[active]
        mid = (a_lo + a_hi + 1) // 2
        level = np.frexp(mid.astype(np.float64))[1] - 1  # floor(log2(mid)), exact for these sizes
        w_max = np.maximum(table[level, active], table[level, active + mid - (1 << level)])
        side_sum = None if cum_extra is None else cum_extra[active + mid] - cum_extra[active]
        ok = cost.per_sample_cost_ok(w_max, mid, side_sum)  # the test CostModel applies to each prefix
        lo[active] = np.where(ok, mid, a_lo)
        hi[active] = np.where(ok, a_hi, mid - 1)
        active = active[lo[active] < hi[active]]
    return lo


def _dp_segments(tokens: np.ndarray, counts: np.ndarray, ideal: np.ndarray, efficiency: float,
                 multiple: int) -> List[tuple]:
    """Choose disjoint runs maximising sum(tokens / efficiency - ideal); others are carried.

    A run [i, j) may start at i when j - i <= counts[i], and j - i is a multiple of
    ``multiple`` where counts[i] >= multiple. With best[i] the value of samples i.. and
    g[j] = scale * cum[j] + best[j]:

        best[i] = max(best[i + 1], max over allowed j of g[j] - scale * cum[i] - ideal[i]).

    The allowed j lie in (i, i + counts[i]], whose end never grows as i falls when the
    counts are those of CostModel.max_counts_sorted (a feasible run from i, less its
    first sample, is feasible from i + 1). So the inner max is a sliding-window maximum,
    O(n) in all with monotonic deques: one per residue of j mod ``multiple`` for runs of
    a multiple, one over every j for starts whose counts are below the multiple.
    Ties go to the shortest run; a run is emitted when it ties carrying (within _TIE).

    Example:
        >>> _dp_segments(np.array([10., 10., 10.]), np.array([2, 2, 1]), np.array([20., 20., 10.]), 1.0, 1)
        [(0, 2), (2, 3)]
    """
    n = len(tokens)
    counts = np.maximum(np.asarray(counts, dtype=np.int64), 0)
    cum_a = np.concatenate(([0.0], np.cumsum(tokens, dtype=np.float64)))
    scale = 1.0 / efficiency
    # Python floats and ints: the loop below is scalar work, where lists beat numpy.
    cum, ends = cum_a.tolist(), (np.arange(n) + counts).tolist()
    below_multiple = (counts < multiple).tolist()
    ideal = np.asarray(ideal, dtype=np.float64).tolist()
    scaled = (scale * cum_a).tolist()
    g = scaled[:]  # best[n] = 0
    best = [0.0] * (n + 1)
    take = [0] * n
    # Each deque holds candidate ends j, newest (smallest) on the right, with g strictly
    # decreasing from left to right: a new j whose g is at least an older one's is as
    # good for every later start and the shorter run, so the older one goes. After the
    # ends beyond the window are popped, the leftmost entry is the best allowed end.
    by_residue = [deque() for _ in range(multiple)]
    every: deque = deque()
    for i in range(n - 1, -1, -1):
        if multiple > 1:
            gj = g[i + 1]
            while every and g[every[-1]] <= gj:
                every.pop()
            every.append(i + 1)
        dq = by_residue[i % multiple]
        j = i + multiple
        if j <= n:
            gj = g[j]
            while dq and g[dq[-1]] <= gj:
                dq.pop()
            dq.append(j)
        if below_multiple[i]:
            dq = every
        e = ends[i]
        while dq and dq[0] > e:  # ends only shrink from here on: gone for good
            dq.popleft()
        b = best[i + 1]
        if dq and e > i:
            j = dq[0]
            # Evaluated as the run itself, so best[] is the direct sum of its runs' values.
            v = scale * (cum[j] - cum[i]) - ideal[i] + best[j]
            if v >= b - _TIE:  # a run that just reaches pack_efficiency is emitted
                b = v
                take[i] = j - i
        best[i] = b
        g[i] = scaled[i] + b
    segs, i = [], 0
    while i < n:
        if take[i]:
            segs.append((i, i + take[i]))
            i += take[i]
        else:
            i += 1
    return segs


@dataclasses.dataclass(frozen=True)
class SortedPool:
    """A pool's samples that fit a batch, sorted by decreasing padded length (the order the padded planners
    cut consecutive runs from), and those that alone exceed the budget (``oversize``, positions).

    Example:
        >>> pool = SortedPool.of(np.array([5, 30, 200, 10]), np.arange(4), CostModel((100,)), None)
        >>> pool.order.tolist(), pool.padded.ravel().tolist(), pool.oversize.tolist()
        ([1, 3, 0], [30, 10, 5], [2])
    """

    lengths: np.ndarray  # (n, D) every sample's real lengths, in the pool's order
    order: np.ndarray  # positions of the samples that fit, sorted
    padded: np.ndarray  # their padded lengths, in that order
    patches: Optional[np.ndarray]  # their side counts (patches; (n, 2) with supervised tokens), in that order
    oversize: np.ndarray  # positions of the samples that alone exceed the budget
    fits: np.ndarray  # copies of each sample (every position) that fit one batch

    @classmethod
    def of(cls, lengths: np.ndarray, ids: np.ndarray, cost: CostModel, patches: Optional[np.ndarray]
           ) -> "SortedPool":
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim == 1:
            lengths = lengths[:, None]
        ids = np.asarray(ids)
        cost.check_dims(lengths.shape[1])
        padded = cost.pad(lengths)
        fits = cost.copies_that_fit(padded, patches)
        ok = np.flatnonzero(fits > 0)
        order = ok[sort_order(padded[ok], ids[ok])]
        return cls(lengths, order, padded[order], None if patches is None else np.asarray(patches)[order],
                   np.flatnonzero(fits == 0), fits)


def plan_window(
    lengths: np.ndarray,
    ids: np.ndarray,
    cost: CostModel,
    *,
    final: bool,
    pack_efficiency: float = 0.95,
    carry_limit: int = 512,
    patches: Optional[np.ndarray] = None,
) -> PoolPlan:
    """Plan one pool of samples.

    Args:
        lengths: (n, D) or (n,) real lengths of the pooled samples.
        ids: (n,) distinct sample ids, used only to break ties deterministically.
        cost: the cost model.
        final: the data has ended: emit everything (no carry).
        pack_efficiency: emit a run when its tokens reach this share of a full batch.
        carry_limit: the most samples carried to the next window.
        patches: the samples' side counts when a patch cap or side costs are set: (n,) image patches,
            or (n, 2) image patches and supervised tokens (``odb.plan.costs.cost.split_side``).

    Example:
        >>> import numpy as np
        >>> cm = CostModel((100,))
        >>> plan = plan_window(np.array([50, 50, 10, 10]), np.arange(4), cm, final=True)
        >>> [g.tolist() for g in plan.groups]
        [[0, 1], [2, 3]]
    """
    if cost.packed:  # one padding-free row per batch: bin packing (odb.plan.windows.packing)
        return plan_packed_window(lengths, ids, cost, final=final, pack_efficiency=pack_efficiency,
                                  carry_limit=carry_limit, patches=patches)
    pool = SortedPool.of(lengths, ids, cost, patches)
    if not len(pool.order):
        return PoolPlan([], np.empty(0, dtype=np.int64), pool.oversize)
    lengths, order, pad_s, patch_s, fits = pool.lengths, pool.order, pool.padded, pool.patches, pool.fits
    counts = _max_counts_sorted(cost, pad_s, patch_s)
    if final:
        runs = [np.arange(s, e) for s, e in greedy_segments(counts, cost.multiple)]
    else:
        tokens = cost.plan_tokens(lengths[order], pad_s)
        ideal = fits[order] * pad_s.sum(axis=1).astype(np.float64)
        runs = [np.arange(s, e) for s, e in _dp_segments(tokens, counts, ideal, pack_efficiency, cost.multiple)]
        runs += _drain_carry(runs, tokens, ideal, pad_s, patch_s, cost, carry_limit)
    taken = np.zeros(len(order), dtype=bool)
    for r in runs:
        taken[r] = True
    runs.sort(key=lambda r: int(r[0]))
    return PoolPlan([order[r] for r in runs], order[~taken], pool.oversize)


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
    sub_counts = _max_counts_sorted(cost, pad_s[carried], sub_patches)
    cut = greedy_segments(sub_counts, cost.multiple)
    starts = np.array([s for s, _ in cut])
    quality = np.add.reduceat(tokens[carried], starts) / np.maximum(ideal[carried[starts]], 1.0)
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
    if cost.packed:
        return balanced_rows(lengths, ids, cost, n_groups, patches)
    lengths = np.asarray(lengths, dtype=np.int64).reshape(len(ids), -1)
    if len(lengths) == 0 or n_groups <= 0:
        return []
    padded = cost.pad(lengths)
    order = sort_order(padded, np.asarray(ids))
    pad_s = padded[order]
    patch_s = None if patches is None else np.asarray(patches)[order]

    def cut(scale: float) -> List[tuple]:
        return greedy_segments(_max_counts_sorted(cost.scaled(scale), pad_s, patch_s), cost.multiple)

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
