"""The padded layout's runs: consecutive samples of a SortedPool, what each costs and the greedy cuts
under a cap (``_Runs``)."""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from odb.plan.cost import CostModel
from odb.plan.planner import SortedPool, _max_counts_sorted


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """The sorted samples as blocks of one padded length (one dimension, no side costs), for the block estimate
    of a greedy cut (``_Runs.estimate``)."""

    start: np.ndarray  # (blocks,) each block's first sample
    end: np.ndarray  # one past its last
    g: np.ndarray  # its samples' padded length
    fit: np.ndarray  # copies of one of its samples that fit a batch (not cut short by the samples left)

    @classmethod
    def of(cls, g: np.ndarray, pad: np.ndarray, cost: CostModel) -> _Blocks:
        change = np.flatnonzero(np.diff(g)) + 1
        start = np.concatenate(([0], change)).astype(np.int64)
        return cls(start, np.concatenate((change, [len(g)])).astype(np.int64), g[start],
                   cost.copies_that_fit_unrounded(pad[start]))


@dataclasses.dataclass(frozen=True)
class _RangeMax:
    """What run costs need with several dimensions or side costs (``_Runs.cost``, ``_Runs.cost_of``): a sparse
    table of the padded lengths' range maxima per dimension and the prefix sums of the side costs."""

    table: List[np.ndarray]  # per dimension: at l * n + i the max of pad[i : i + 2**l] (cut at n)
    table_lists: List[List[float]]  # the same as Python lists
    cum_extra: Optional[np.ndarray]  # (n + 1,) prefix sums of the side costs; None: no side costs
    cum_extra_list: Optional[List[float]]

    @classmethod
    def of(cls, pad: np.ndarray, extra: Optional[np.ndarray], longest: int) -> _RangeMax:
        """``longest``: the longest run (two overlapping levels cover a run up to it)."""
        n, dims = pad.shape
        levels = [pad.astype(np.float64)]
        while (1 << len(levels)) <= max(longest, 1):
            half = 1 << (len(levels) - 1)
            nxt = levels[-1].copy()
            nxt[:n - half] = np.maximum(nxt[:n - half], nxt[half:])
            levels.append(nxt)
        table = [np.ascontiguousarray(np.stack(levels)[:, :, d]).ravel() for d in range(dims)]
        cum_extra = None if extra is None else np.concatenate(([0.0], np.cumsum(extra)))
        return cls(table, [t.tolist() for t in table], cum_extra, None if cum_extra is None else cum_extra.tolist())


def _block_ends(g: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """For each sample, the end of the block of consecutive samples with its length and its ``cnt``.

    Example:
        >>> _block_ends(np.array([9, 9, 9, 5, 5]), np.array([2, 2, 1, 3, 3])).tolist()
        [2, 2, 3, 5, 5]
    """
    n = len(g)
    change = np.flatnonzero((g[1:] != g[:-1]) | (cnt[1:] != cnt[:-1])) + 1
    ends = np.append(change, n)
    return np.repeat(ends, np.diff(np.concatenate(([0], ends)))).astype(np.int64)


class _Runs:
    """Consecutive runs of a SortedPool's samples: their group costs, and greedy cuts under a cap.

    A run [s, e) may hold e - s samples when that is at most ``cnt[s]`` (the largest feasible run from s,
    ``_max_counts_sorted``) and, where ``cnt[s]`` reaches ``batch_size_multiple``, a multiple of it or all the
    samples left (as ``least_cost_segments``). Its cost is ``cost.group_cost`` of its samples (padded tokens,
    B x the longest per dimension, plus side costs): with one length dimension and no side costs B x the
    first sample's padded length, otherwise range maxima from a sparse table.
    """

    def __init__(self, pool: SortedPool, cost: CostModel) -> None:
        pad = pool.padded
        self.n, dims = pad.shape
        self.mult = int(cost.multiple)
        self.cnt = _max_counts_sorted(cost, pad, pool.patches).astype(np.int64)
        extra = cost.side_cost(pool.patches)
        self.fast = dims == 1 and extra is None
        self.single = pad.sum(axis=1).astype(np.float64) + (0.0 if extra is None else extra)
        self.cnt_list = self.cnt.tolist()
        self.same_end: List[int] = []  # one dimension, no side costs: where the block of equal (length, cnt) ends
        self.blocks: Optional[_Blocks] = None  # one dimension, no side costs
        self.ranges: Optional[_RangeMax] = None  # otherwise
        if self.fast:
            self.g = pad[:, 0].astype(np.int64)
            self.g_list = self.g.tolist()
            self.same_end = _block_ends(self.g, self.cnt).tolist()
            self.blocks = _Blocks.of(self.g, pad, cost)
        else:
            self.ranges = _RangeMax.of(pad, extra, int(self.cnt.max(initial=1)))
        self.suffix = np.concatenate((np.cumsum(self.single[::-1])[::-1], [0.0]))
        self.c_max = float(self.cost(np.arange(self.n), np.arange(self.n) + self.cnt).max(initial=0.0))
        self._steps_cache: dict = {}

    def cost(self, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Group costs of the runs [s, e) (arrays, e > s), in planning precision (side costs unrounded)."""
        s = np.asarray(s, dtype=np.int64)
        e = np.asarray(e, dtype=np.int64)
        size = e - s
        if self.fast:
            return (size * self.g[s]).astype(np.float64)
        level = np.frexp(size.astype(np.float64))[1] - 1
        first, second = level * self.n + s, level * self.n + e - (1 << level)
        ranges = self.ranges
        out = np.zeros(len(s))
        for table in ranges.table:
            out += np.maximum(table.take(first), table.take(second))
        out *= size
        if ranges.cum_extra is not None:
            out = out + (ranges.cum_extra[e] - ranges.cum_extra[s])
        return out

    def cost_of(self, s: int, e: int) -> float:
        """``cost`` of one run [s, e), in Python scalars."""
        size = e - s
        if self.fast:
            return float(size * self.g_list[s])
        level = size.bit_length() - 1
        first, second = level * self.n + s, level * self.n + e - (1 << level)
        ranges = self.ranges
        out = sum(max(table[first], table[second]) for table in ranges.table_lists) * size
        return out + (ranges.cum_extra_list[e] - ranges.cum_extra_list[s] if ranges.cum_extra is not None else 0.0)

    def longest_runs(self, cap: float, below: Optional[np.ndarray] = None, above: Optional[np.ndarray] = None
                     ) -> np.ndarray:
        """(n,) the longest run from every start that costs at most ``cap`` (before ``batch_size_multiple``).
        ``below`` / ``above``: the answers for a smaller / larger cap, which bracket this one's (a run's cost
        grows with its length), so the search per start runs between them."""
        if self.fast:
            if not np.isfinite(cap):
                return self.cnt
            return np.minimum(np.floor(cap / self.g + 1e-9).astype(np.int64), self.cnt)
        # several dimensions or side costs: binary search on the length, every start at once
        lo = np.zeros(self.n, dtype=np.int64) if below is None else below.copy()
        hi = self.cnt.copy() if above is None else above.copy()
        active = np.flatnonzero(lo < hi)
        while len(active):
            mid = (lo[active] + hi[active] + 1) // 2
            ok = self.cost(active, active + mid) <= cap + 1e-9
            lo[active] = np.where(ok, mid, lo[active])
            hi[active] = np.where(ok, hi[active], mid - 1)
            active = active[lo[active] < hi[active]]
        return lo

    def _steps(self, cap: float, raw: Optional[np.ndarray] = None) -> List[int]:
        """The greedy run length from every start under ``cap`` (0: no run from there fits the cap): the longest
        run (``raw``, default ``longest_runs(cap)``), cut to ``batch_size_multiple`` as ``valid`` allows."""
        key = float(cap)
        hit = self._steps_cache.get(key)
        if hit is not None:
            return hit
        raw = self.longest_runs(cap) if raw is None else raw
        if self.mult > 1:
            rounded = np.where(self.cnt >= self.mult, raw - raw % self.mult, raw)
            raw = np.where(raw == self.n - np.arange(self.n), raw, rounded)
        out = raw.tolist()
        if len(self._steps_cache) > 64:
            self._steps_cache.clear()
        self._steps_cache[key] = out
        return out

    def count(self, i: int, cap: float, limit: int) -> float:
        """Runs of the greedy cut of samples i.. under ``cap`` (stops past ``limit``; inf: infeasible)."""
        n, runs = self.n, 0
        if self.fast and self.mult == 1 and np.isfinite(cap):
            g, cnt, end, c = self.g_list, self.cnt_list, self.same_end, int(math.floor(cap + 1e-9))
            while i < n:
                step = c // g[i]
                if step > cnt[i]:
                    step = cnt[i]
                if step <= 0:
                    return math.inf
                # every run that starts inside a block of equal length and cnt takes the same step: jump them
                k = (end[i] - i) // step
                if k > 1:
                    runs += k
                    if runs > limit:
                        return limit + 1
                    i += k * step
                    continue
                i += step
                runs += 1
                if runs > limit:
                    return runs
            return runs
        steps = self._steps(cap)
        while i < n:
            step = steps[i]
            if step <= 0:
                return math.inf
            i += step
            runs += 1
            if runs > limit:
                return runs
        return runs

    def take(self, i: int, cap: float, k: int) -> List[int]:
        """The ends of (up to) the first k runs of the greedy cut of samples i.. under ``cap``."""
        steps = self._steps(cap)
        ends: List[int] = []
        while i < self.n and len(ends) < k:
            i += max(steps[i], 1)
            ends.append(i)
        return ends

    def estimate(self, i: int, cap: float) -> float:
        """Runs of the greedy cut of i.. under ``cap``, estimated over blocks of equal length (one dimension, no
        side costs): each sample counts 1 / the length of a run starting at it."""
        blocks = self.blocks
        b = int(np.searchsorted(blocks.start, i, side="right")) - 1
        g, fit = blocks.g[b:], blocks.fit[b:]
        step = np.minimum(np.floor(cap / g + 1e-9), fit)
        if self.mult > 1:
            step = np.where(fit >= self.mult, step - step % self.mult, step)
        if step.min() <= 0:
            return math.inf
        size = (blocks.end[b:] - blocks.start[b:]).astype(np.float64)
        size[0] = blocks.end[b] - i
        return float((size / step).sum())

    def min_cap(self, i: int, runs: int) -> Optional[float]:
        """The least cap under which the greedy cut of samples i.. needs at most ``runs`` runs (None: none does).
        With one dimension and no side costs the caps are integers and the search starts from the block
        estimate's answer (``estimate``), which the exact count then corrects."""
        hi = self.c_max
        if self.count(i, hi, runs) > runs:
            return None
        # Below both the cost of sample i alone and the mean cost of a run no cap fits.
        lo = max(float(self.single[i]), float(self.suffix[i]) / runs)
        if self.fast:
            lo = float(math.ceil(lo - 1e-9) - 1)  # an integer cap known not to fit
            a, b = lo, hi  # the estimate: the least cap whose estimated count is at most ``runs``
            while b - a > 0.5:
                mid = math.floor((a + b) / 2)
                if self.estimate(i, mid) <= runs + 1e-9:
                    b = mid
                else:
                    a = mid + 1
            guess = float(b)
            # the exact cap lies near the estimate: gallop from it, then bisect
            gap = max(1.0, float(self.g[i]) / 4)
            if self.count(i, guess, runs) <= runs:
                hi, probe = guess, guess - gap
                while probe > lo and self.count(i, probe, runs) <= runs:
                    hi, gap = probe, gap * 2
                    probe = hi - gap
                lo = max(lo, probe)
            else:
                lo, probe = guess, guess + gap
                while probe < hi and self.count(i, probe, runs) > runs:
                    lo, gap = probe, gap * 2
                    probe = lo + gap
                hi = min(hi, probe) if probe < hi else hi
            while hi - lo > 0.5:
                mid = math.floor((lo + hi) / 2)
                if mid <= lo:
                    break
                if self.count(i, mid, runs) <= runs:
                    hi = mid
                else:
                    lo = mid
            return float(hi)
        # several dimensions or side costs: bisect the cap on exact counts, each count's longest runs searched
        # between those of the bracketing caps
        below, above = None, None
        for _ in range(60):
            if hi - lo <= max(0.5, 1e-6 * hi):
                break
            mid = (lo + hi) / 2
            raw = self.longest_runs(mid, below, above)
            self._steps(mid, raw)
            if self.count(i, mid, runs) <= runs:
                hi, above = mid, raw
            else:
                lo, below = mid, raw
        return float(hi)

    def slot_cut(self, sizes: Sequence[int]) -> Optional[Tuple[List[Tuple[int, int]], int]]:
        """Runs cut slot by slot: slot j takes up to ``sizes[j]`` runs, each as long as the least cap under
        which the samples left fit the runs left allows (``min_cap``). Returns the runs and where the last
        slot's begin; None: they do not fit."""
        bounds, i, left, last_start = [], 0, int(sum(sizes)), self.n
        for j, size in enumerate(sizes):
            if i >= self.n:
                break
            last = j == len(sizes) - 1
            if last:
                last_start = i
            cap = self.min_cap(i, size if last else left)
            if cap is None:
                return None
            ends = self.take(i, cap, size)
            bounds.extend(zip([i] + ends[:-1], ends))
            i, left = ends[-1], left - size
        return (bounds, last_start) if i >= self.n else None

    def longest(self, i: int, cap: float, keep: int = 0) -> int:
        """The longest valid run from i that costs at most ``cap`` and leaves ``keep`` samples (0: none fits)."""
        n, k = self.n, self.cnt_list[i]
        if self.fast:
            size = min(k, int(cap + 1e-9) // self.g_list[i]) if np.isfinite(cap) else k
        else:
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.cost_of(i, i + mid) <= cap + 1e-9:
                    lo = mid
                else:
                    hi = mid - 1
            size = lo
        size = min(size, n - i - keep)
        if self.mult > 1 and k >= self.mult and i + size != n:
            size -= size % self.mult
        return max(size, 0)

    def complement(self, i: int, totals: np.ndarray, limit: float, run_cap: float
                   ) -> Optional[Tuple[List[Tuple[int, int]], np.ndarray]]:
        """Cut samples i.. into one run per rank so that the largest rank total (``totals`` plus its run) is
        least: bisect that largest total tau; given tau the ranks, least total first, take in turn the longest
        run within tau less their total and within ``run_cap`` (leaving a sample for each rank after them).
        Returns the runs, in sample order, and the rank of each; None when no tau up to ``limit`` fits."""
        world = len(totals)
        if self.n - i < world:
            return None
        by_total = np.argsort(totals, kind="stable")
        ordered = totals[by_total].tolist()

        n = self.n
        plain = self.fast and self.mult == 1

        def cover(tau: float) -> Optional[List[int]]:
            ends, at = [], i
            g, cnt = (self.g_list, self.cnt_list) if plain else (None, None)
            for k, t in enumerate(ordered):
                if plain:  # longest() inlined: one dimension, no side costs, no batch_size_multiple
                    cap = min(tau - t, run_cap)
                    size = min(cnt[at], int(cap + 1e-9) // g[at] if cap < 1e18 else n, n - at - (world - k - 1))
                else:
                    size = self.longest(at, min(tau - t, run_cap), keep=world - k - 1)
                if size <= 0:
                    return None
                at += size
                ends.append(at)
            return ends if at >= n else None

        if cover(limit) is None:
            return None
        lo = max(ordered[-1], (sum(ordered) + float(self.suffix[i])) / world)
        hi = float(limit)
        while hi - lo > (0.5 if self.fast else max(0.5, 1e-6 * hi)):
            mid = math.floor((lo + hi) / 2) if self.fast else (lo + hi) / 2
            if mid <= lo:
                break
            if cover(mid) is not None:
                hi = mid
            else:
                lo = mid
        ends = cover(hi)
        return list(zip([i] + ends[:-1], ends)), by_total

    def split(self, s: int, e: int) -> Optional[Tuple[int, float, float]]:
        """The cut of run [s, e) into two runs whose costlier is cheapest: (cut, cost, cost); None: no cut."""
        if e - s < 2:
            return None
        cut = np.arange(s + 1, e)
        ok = np.ones(len(cut), dtype=bool)
        if self.mult > 1:
            ok &= self._size_ok(np.full(len(cut), s), cut - s) & self._size_ok(cut, e - cut)
        if not ok.any():
            return None
        cut = cut[ok]
        left, right = self.cost(np.full(len(cut), s), cut), self.cost(cut, np.full(len(cut), e))
        worst = np.maximum(left, right)
        k = int(np.lexsort((cut, left + right, worst))[0])
        return int(cut[k]), float(left[k]), float(right[k])

    def valid(self, s: np.ndarray, e: np.ndarray) -> np.ndarray:
        """Whether each run [s, e) (arrays) may be a micro-batch: non-empty, within the largest feasible run
        from s, and of a size ``batch_size_multiple`` allows."""
        size = e - s
        ok = (size >= 1) & (size <= self.cnt[np.minimum(s, self.n - 1)])
        return ok & self._size_ok(s, size) if self.mult > 1 else ok

    def _size_ok(self, s: np.ndarray, size: np.ndarray) -> np.ndarray:
        k = self.cnt[s]
        return (k < self.mult) | (size % self.mult == 0) | (s + size == self.n)
