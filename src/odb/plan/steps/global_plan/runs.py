"""The padded layout's runs: consecutive samples of a SortedPool, what each costs and the greedy cuts
under a cap (``_Runs``), over the precomputed tables of ``run_tables``."""

from __future__ import annotations

import bisect
import functools
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.steps.global_plan.run_tables import Blocks, RangeMax, block_ends, fit_is_count
from odb.plan.windows.planner import SortedPool, _max_counts_sorted


_NO_CAP = 1 << 62  # an integer cap no run reaches
_GROUP_WALK = 16  # ranks of one cap in a row from which ``_cover_by_caps`` walks segments


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
        self.longest_run = int(self.cnt.max(initial=1))  # no valid run is longer
        self.blocks: Optional[Blocks] = None  # one dimension, no side costs
        # one dimension, no side costs, no batch_size_multiple, cnt the blocks' fit cut by the samples left: the
        # greedy cuts walk segments of blocks of one step (``_walk``, ``_take_segments``)
        self.by_segments = False
        self.ranges: Optional[RangeMax] = None  # otherwise
        if self.fast:
            self.g = pad[:, 0].astype(np.int64)
            self.g_list = self.g.tolist()
            self.blocks = Blocks.of(self.g, pad, cost)
            self.by_segments = self.mult == 1 and fit_is_count(self.blocks, self.cnt)
        else:
            self.ranges = RangeMax.of(pad, extra, self.longest_run)
        self.suffix = np.concatenate((np.cumsum(self.single[::-1])[::-1], [0.0]))
        self.c_max = float(self.cost(np.arange(self.n), np.arange(self.n) + self.cnt).max(initial=0.0))
        self._steps_cache: dict = {}
        self._segments_cache: dict = {}

    @functools.cached_property
    def cnt_list(self) -> List[int]:
        """``cnt`` as a Python list."""
        return self.cnt.tolist()

    @functools.cached_property
    def same_end(self) -> List[int]:
        """One dimension, no side costs: where the block of equal (length, cnt) of each sample ends."""
        return block_ends(self.g, self.cnt).tolist()

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
        if self.by_segments:
            runs = self._walk(i, int(math.floor(cap + 1e-9)) if np.isfinite(cap) else _NO_CAP, limit)[0]
            return runs if runs <= limit or math.isinf(runs) else limit + 1
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

    def _segments(self, i: int, c: int) -> Tuple[List[int], List[int], List[bool]]:
        """The samples as segments of consecutive blocks that take one greedy step under the integer cap c
        (``by_segments``), from the one that holds sample i: each segment's first sample (then n), its step
        min(c // length, fit) and whether the cap (not the fit) sets that step. The segments of the last caps
        are kept (a slot's cut asks again for the cap of the slot before)."""
        hit = self._segments_cache.get(c)
        if hit is None:
            blocks = self.blocks
            per_cap = c // blocks.g
            step = np.minimum(per_cap, blocks.fit)
            capped = per_cap < blocks.fit
            first = np.flatnonzero(np.concatenate(([True], (step[1:] != step[:-1]) | (capped[1:] != capped[:-1]))))
            hit = blocks.start[first].tolist() + [self.n], step[first].tolist(), capped[first].tolist()
            if len(self._segments_cache) >= 16:
                self._segments_cache.clear()
            self._segments_cache[c] = hit
        starts, steps, capped = hit
        k = bisect.bisect_right(starts, i) - 1
        return starts[k:], steps[k:], capped[k:]

    def _walk(self, i: int, c: int, limit: int) -> Tuple[float, int, float]:
        """The greedy cut of samples i.. under the integer cap c, a segment at a time (``_segments``):
        (runs, top, above): its runs (inf where a sample on it fits no run), its costliest run's cost, and a cap
        above c. Every cap from ``top`` to c cuts the same runs; every cap from c to ``above`` - 1 cuts the same
        first limit + 1 runs (so, when there are more than ``limit``, as many runs at least)."""
        n, g = self.n, self.g_list
        starts, steps, capped = self._segments(i, c)
        p, runs, top, above = i, 0, 0, math.inf
        for s, end, by_cap in zip(steps, starts[1:], capped):
            if p >= end:  # the run before took this segment's samples
                continue
            if s <= 0:
                return math.inf, top, min(above, g[p]) if runs <= limit else above
            r = (end - p + s - 1) // s  # runs that start in this segment, each s long (the last cut at n)
            if by_cap and runs <= limit:  # a cap of (s + 1) x the length of the first sample of its last run
                last = min(r, limit + 1 - runs) - 1  # (of the first limit + 1) lengthens that run
                above = min(above, (s + 1) * g[p + last * s])
            first = (s if s < n - p else n - p) * g[p]  # the segment's first run is its costliest
            if first > top:
                top = first
            runs += r
            p += r * s
        return runs, top, above

    def _take_segments(self, i: int, c: int, k: int) -> List[int]:
        """``take`` under the integer cap c, a segment at a time (``_segments``)."""
        n = self.n
        starts, steps, _ = self._segments(i, c)
        ends: List[int] = []
        p, left = i, k
        for s, end in zip(steps, starts[1:]):
            if p >= end:
                continue
            s = max(s, 1)  # as ``take``: a sample that fits no run under the cap still moves the cut on
            r = min((end - p + s - 1) // s, left)
            ends.extend(range(p + s, p + r * s + 1, s))
            p, left = p + r * s, left - r
            if left == 0 or p >= n:
                break
        if ends and ends[-1] > n:  # the last run ends with the samples
            ends[-1] = n
        return ends

    def _min_cap_segments(self, i: int, runs: int, hint: Optional[float]) -> Optional[float]:
        """``min_cap`` a segment walk at a time (``by_segments``): the least integer cap is searched between a cap
        that does not fit and one that does, a cap that fits lowering the upper end to its cut's costliest run
        and one that does not raising the lower end to just below the least cap that may change its first runs
        (``_walk``). The next cap tried is where the line through the two ends' run counts meets ``runs``
        (a bisection after a try that did not halve the gap). ``hint``: a cap known to fit, if any (the slot
        before's: the runs it cut leave the rest fitting the runs left); the caps fall slot by slot, often not
        at all, so one below the first that fits is tried first."""
        lo = math.ceil(max(float(self.g_list[i]), float(self.suffix[i]) / runs) - 1e-9) - 1  # does not fit
        lo_runs = hi = hi_runs = None
        for cap in ((hint, self.c_max) if hint is not None else (self.c_max,)):
            got, top, _ = self._walk(i, int(math.floor(cap + 1e-9)), runs)
            if got <= runs:
                hi, hi_runs = top, got
                break
        if hi is None:
            return None
        tight, interpolate = True, True
        while hi - lo > 1:
            gap = hi - lo
            if tight:
                mid = hi - 1
            elif interpolate and lo_runs is not None:
                mid = lo + math.ceil((lo_runs - runs) * gap / (lo_runs - hi_runs))
                mid = min(max(mid, lo + 1), hi - 1)
            else:
                mid = (lo + hi) // 2
            got, top, above = self._walk(i, mid, runs)
            if got <= runs:
                hi, hi_runs = top, got
            else:
                lo, lo_runs = max(mid, above - 1), (got if got < math.inf else None)
            interpolate = tight or not interpolate or 2 * (hi - lo) <= gap  # bisect once after a poor guess
            tight = False
        return float(hi)

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

    def slot_cut(self, sizes: Sequence[int], hint: Optional[float] = None
                 ) -> Tuple[Optional[Tuple[np.ndarray, np.ndarray, int]], Optional[float]]:
        """Runs cut slot by slot: slot j takes up to ``sizes[j]`` runs, each as long as the least cap under
        which the samples left fit the runs left allows (``min_cap``). Returns the runs' starts and ends (arrays,
        in sample order) and where the last slot's begin (None: they do not fit), and the first slot's cap (None:
        none). ``hint``: a cap under which all the samples fit ``sum(sizes)`` runs, if known (the first cap of a
        cut into fewer runs)."""
        cut, first_cap = None, None
        ends: List[int] = []
        i, left, last_start, cap = 0, int(sum(sizes)), self.n, hint
        for j, size in enumerate(sizes):
            if i >= self.n:
                break
            last = j == len(sizes) - 1
            if last:
                last_start = i
            if self.by_segments:
                cap = self._min_cap_segments(i, size if last else left, cap)
            else:
                cap = self.min_cap(i, size if last else left)
            if cap is None:
                return None, first_cap
            first_cap = cap if j == 0 else first_cap
            got = self._take_segments(i, int(cap), size) if self.by_segments else self.take(i, cap, size)
            ends.extend(got)
            i, left = got[-1], left - size
        if i >= self.n:
            ends_array = np.array(ends, dtype=np.int64)
            cut = np.concatenate(([0], ends_array[:-1])), ends_array, last_start
        return cut, first_cap

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
        ordered_array = np.asarray(ordered, dtype=np.float64)

        def cover_plain(tau: float) -> Optional[List[int]]:
            """``cover`` with ``longest`` inlined (one dimension, no side costs, no batch_size_multiple): the
            ranks' integer caps at once, then ``_cover_by_caps``."""
            caps = np.minimum(tau - ordered_array, run_cap)
            whole = np.where(caps < 1e18, np.trunc(caps + 1e-9), 0.0).astype(np.int64)
            whole[caps >= 1e18] = _NO_CAP
            return self._cover_by_caps(i, whole)

        def cover(tau: float) -> Optional[List[int]]:
            if plain:
                return cover_plain(tau)
            ends, at = [], i
            for k, t in enumerate(ordered):
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

    def _cover_by_caps(self, i: int, caps: np.ndarray) -> Optional[List[int]]:
        """The ends of one run per rank from sample i (``complement``'s cover with one dimension, no side costs
        and no batch_size_multiple): rank k in turn takes the longest run within its integer cap ``caps[k]`` that
        leaves a sample for each rank after it. None: a rank gets no sample, or samples are left. Ranks of one
        cap in a row take their runs a segment at a time (``_runs_within``, with ``by_segments``) until one would
        end at its bound."""
        world, n = len(caps), self.n
        group_ends = (np.flatnonzero(caps[1:] != caps[:-1]) + 1).tolist() + [world]
        caps_list = caps.tolist()
        ends: List[int] = []
        at, k, by_rank = i, 0, not self.by_segments
        for group_end in group_ends:  # ranks k .. group_end - 1 have one cap
            if not by_rank and group_end - k >= _GROUP_WALK:
                got = self._runs_within(at, caps_list[k], group_end - k, n - world + k + 1)
                if got is None:
                    return None
                if got:
                    ends.extend(got)
                    k, at = k + len(got), got[-1]
                by_rank = k < group_end  # cut short at a bound (near the end): the rest a rank at a time
            if k < group_end:
                g, cnt = self.g_list, self.cnt_list
            while k < group_end:
                size = min(cnt[at], caps_list[k] // g[at], n - world + k + 1 - at)
                if size <= 0:
                    return None
                at += size
                ends.append(at)
                k += 1
        return ends if at >= n else None

    def _runs_within(self, at: int, c: int, ranks: int, stop: int) -> Optional[List[int]]:
        """The ends of up to ``ranks`` greedy runs from ``at`` under the integer cap c, a segment at a time
        (``_segments``), the j-th ending by stop + j; it stops before the first run that its bound would cut
        (None: a sample under the cap fits no run)."""
        starts, steps, _ = self._segments(at, c)
        ends: List[int] = []
        p, done = at, 0
        for s, end in zip(steps, starts[1:]):
            if p >= end:
                continue
            if s <= 0:
                return None
            slack = stop + done - p  # shrinks by s - 1 a run
            if s == 1:
                free = ranks if slack >= 1 else 0
            else:
                free = (slack - s) // (s - 1) + 1 if slack >= s else 0
            want = min((end - p + s - 1) // s, ranks - done)
            r = min(want, free)
            if r > 0:
                ends.extend(range(p + s, p + r * s + 1, s))
                p, done = p + r * s, done + r
            if done == ranks or r < want:
                break
        return ends

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
