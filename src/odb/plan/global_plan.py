"""One optimizer step's samples planned jointly over all data-parallel ranks (pure numpy).

With ``global_batch_size=G`` a step holds exactly G given samples, the union over W ranks. Each rank
runs M micro-batches (the same M on every rank: a rank with nothing for a micro-step runs a *ghost*, an
empty forward) and the slowest rank sets the step time (DDP waits at the step's all-reduce, FSDP at
every micro-step). A rank's cost is the sum over its micro-batches of ``cost.group_cost`` plus the fixed
cost of one micro-batch (``overhead``, config ``micro_batch_cost``). ``plan_global_step`` assigns all the
step's samples to (rank, micro-batch) cells so that the slowest rank costs little, and so that the j-th
micro-batches of the ranks cost alike (FSDP meets there):

* Padded layout: the samples, sorted as the window planner sorts them (``SortedPool``), are cut into
  K = W x M consecutive runs, each within the budget. For each candidate M (from the fewest micro-steps
  the budget allows, up while M's lower bound can still beat the best plan so far) the runs are cut
  *slot by slot*: the next W runs take the longest samples left, each as long as a cap c_j allows, c_j
  being the least cap under which the samples left fit the runs left (a binary search on the cap with
  the greedy count, started from an estimate over blocks of equal length). The caps fall from slot to
  slot, so the runs of a slot cost about the same, and a long sample that forces a high cap makes the
  other runs of its slot take more samples. Runs are split (the costliest, at its best cut) while there
  are fewer than K: a rank runs a ghost only when the step has fewer samples than cells.
* Packed layout (a micro-batch is one row costing the sum of its samples' weights): K = W x M rows, M from
  ceil(total weight / budget / W) up; the samples, heaviest first, each go to the least-loaded row that
  can take them (LPT, in vectorised rounds); when one fits no row, best-fit decreasing rows
  (``odb.plan.packing``) split up to K, or a larger M.
* Dealing: the K micro-batches by cost, micro-step j takes the j-th W of them and gives the costliest to
  the rank whose total is the least so far (each micro-step balanced, and the ranks' totals); with ghosts
  the costliest also go, one at a time, to the rank with the least total that has a free micro-step.
* Evening out: the last micro-step may instead be cut to complement the ranks' totals after the others
  (bisect the slowest total; the least-loaded rank first takes the longest run within it); then a local
  search on the slowest rank moves samples to a neighbouring run of another rank, swaps a run with a
  cheaper one of the same micro-step, or hands a run to another rank's ghost (packed: moves one sample to
  another rank's row), while that lowers it (at most 32 moves).

``fsdp`` says where ranks wait. Default (None): the slowest rank first, the FSDP step time (the sum over
micro-steps of the costliest micro-batch) second, and evening out never makes a micro-step's costliest
micro-batch costlier. False (DDP only): evening out may (on heavy-tailed steps of 8 and 1,024 ranks: DDP
efficiency +0.4 to +0.7 points, FSDP efficiency -4 to -6 points). True: the FSDP time first. One rank (W = 1) in the padded layout also tries
the least-cost cut of ``odb.plan.step_cut`` (the optimum over cuts of the sorted samples for one rank), as
does a step of at most 64 samples; every candidate is scored by its dealt plan.

Example:
    >>> cost = CostModel((100,))
    >>> plan = plan_global_step(np.array([50, 48, 12, 10, 10, 9, 30, 30]), 2, cost, overhead=10.0)
    >>> [[g.tolist() for g in groups] for groups in plan.ranks]   # micro-step 0: 30+30 and 50; then 48 and 48
    [[[6, 7], [2, 3, 4, 5]], [[0], [1]]]
    >>> plan.rank_costs.tolist(), plan.bound
    ([128.0, 118.0], 119.5)
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import List, Optional, Sequence, Tuple

import numpy as np

from odb.plan.cost import CostModel, split_side
from odb.plan.packing import _pack, _sorted_sizes
from odb.plan.planner import SortedPool, _max_counts_sorted
from odb.plan.step_cut import least_cost_segments

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False  # the one ghost array every plan shares
_SMALL_STEP = 64  # up to this many samples the padded planner also tries the least-cost cut
_SMALL_ROWS = 512  # packed: up to this many rows the plan gets a local search
_SMALL_WORLD = 32  # several dimensions or side costs: up to this many ranks the last micro-step is complemented
_MAX_TRIES = 3  # candidate M values tried past the last one that improved the slowest rank
_IMPROVE_STEPS = 32  # local-search moves on the slowest rank


@dataclasses.dataclass(frozen=True)
class GlobalStepPlan:
    """One step planned over W ranks: positions into the step's samples.

    ranks: ``ranks[r][j]`` the positions of rank r's micro-batch j; every rank has ``micro_steps`` of them;
        an empty array is a ghost micro-batch (the rank runs an empty forward for that micro-step).
    oversize: positions of samples that alone exceed the budget, not planned (the caller's oversize policy
        decides); empty when the plan was asked to give them micro-batches of their own (``alone``).
    rank_costs: (W,) each rank's cost: the sum over its micro-batches of ``cost.group_cost`` of its samples
        plus ``overhead``, a ghost costing ``overhead`` alone.
    bound: a lower bound on ``rank_costs.max()`` of any plan of these samples (see ``plan_global_step``).

    Example:
        >>> plan = GlobalStepPlan([[np.array([0]), np.array([2])], [np.array([1]), np.empty(0, dtype=np.int64)]],
        ...                       np.empty(0, dtype=np.int64), np.array([30.0, 20.0]), 25.0)
        >>> plan.micro_steps, plan.ghosts
        (2, 1)
    """

    ranks: List[List[np.ndarray]]
    oversize: np.ndarray
    rank_costs: np.ndarray
    bound: float

    @property
    def micro_steps(self) -> int:
        """M: the number of micro-batches of every rank."""
        return len(self.ranks[0]) if self.ranks else 0

    @property
    def ghosts(self) -> int:
        """How many micro-batches are ghosts (empty), over all ranks."""
        return sum(1 for groups in self.ranks for g in groups if len(g) == 0)


def plan_global_step(lengths: np.ndarray, world: int, cost: CostModel, overhead: float,
                     patches: Optional[np.ndarray] = None, alone: bool = False, *, fsdp: Optional[bool] = None
                     ) -> GlobalStepPlan:
    """Assign one step's samples to W ranks x M micro-batches, each within the budget, so that the slowest
    rank costs little (the module docstring says how).

    Args:
        lengths: (n,) or (n, D) int lengths of the step's samples (all ranks' together).
        world: W, the number of data-parallel ranks.
        cost: the cost model (budget, padding, layout, side costs, ``batch_size_multiple``).
        overhead: the fixed cost of one micro-batch in tokens (``micro_batch_cost``), ghosts included.
        patches: the samples' side counts when a patch cap or side costs are set: None, (n,) image patches
            or (n, 2) image patches and supervised tokens (``odb.plan.cost.split_side``).
        alone: samples that alone exceed the budget become micro-batches of their own instead of ``oversize``.
        fsdp: where the ranks wait. None (default, either): the slowest rank first, then the sum over micro-steps
            of the costliest micro-batch, and the ranks' totals are never evened out by making a micro-step's
            costliest micro-batch costlier. False (DDP: the ranks meet once a step): the slowest rank alone, which
            may unbalance micro-steps for a little gain (the module docstring has figures). True (FSDP: they meet
            at every micro-step): that sum first, the slowest rank second, micro-steps protected.

    Returns a ``GlobalStepPlan``. Every sample not oversize is in exactly one micro-batch; every micro-batch
    fits the budget (as ``cost.max_counts_sorted`` / ``odb.plan.packing`` say) and, padded, has a size that
    is a multiple of ``batch_size_multiple`` where ``least_cost_segments`` asks for one; same input, same plan.

    ``bound`` = max(S / W, s_max) + M_lb x overhead, where s_k is a lower bound on the cost of any micro-batch
    holding sample k (padded: its padded tokens plus the floor of its side cost; packed: the floor of its
    weight), S the sum and s_max the largest of them over the planned samples, and M_lb = ceil(N / W) with N
    a lower bound on the number of micro-batches (padded: ceil(sum of 1 / copies of each sample that fit a
    batch); packed: ceil(total weight / budget), or n / max_batch_size; plus one per sample planned alone).
    Any plan's slowest rank costs at least that: the ranks' costs sum to at least S + W x M x overhead, and
    the rank holding the costliest sample pays s_max plus M overheads, with M >= M_lb.

    Example:
        >>> plan = plan_global_step(np.array([60, 10, 10, 10, 10, 10, 200]), 2, CostModel((100,)), 5.0)
        >>> [[g.tolist() for g in groups] for groups in plan.ranks], plan.oversize.tolist()
        ([[[0]], [[1, 2, 3, 4, 5]]], [6])
        >>> plan.rank_costs.tolist()
        [65.0, 55.0]
        >>> alone = plan_global_step(np.array([60, 10, 10, 10, 10, 10, 200]), 2, CostModel((100,)), 5.0, alone=True)
        >>> [[g.tolist() for g in groups] for groups in alone.ranks], alone.oversize.tolist(), alone.rank_costs.tolist()
        ([[[6], [4, 5]], [[0], [1, 2, 3]]], [], [230.0, 100.0])
        >>> ddp = plan_global_step(np.array([60, 10, 10, 10, 10, 10, 200]), 2, CostModel((100,)), 5.0, alone=True,
        ...                        fsdp=False)  # the slowest rank first: micro-step 1 may cost more (40, not 30)
        >>> [[g.tolist() for g in groups] for groups in ddp.ranks], ddp.rank_costs.tolist()
        ([[[6], [5]], [[0], [1, 2, 3, 4]]], [220.0, 110.0])
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim == 1:
        lengths = lengths[:, None]
    if lengths.ndim != 2:
        raise ValueError(f"lengths has shape {lengths.shape}: pass (n,) or (n, D) int lengths of the step's samples.")
    world = int(world)
    if world < 1:
        raise ValueError(f"world={world}: the number of data-parallel ranks must be >= 1.")
    overhead = float(overhead)
    if not np.isfinite(overhead) or overhead < 0:
        raise ValueError(f"overhead={overhead!r}: the cost of one micro-batch must be a finite number >= 0 (tokens).")
    cost.check_dims(lengths.shape[1])
    side = None if patches is None else np.asarray(patches)
    if cost.packed:
        return _plan_packed(lengths, world, cost, overhead, side, alone, fsdp)
    return _plan_padded(lengths, world, cost, overhead, side, alone, fsdp)


# --------------------------------------------------------------------------- shared: dealing and bounds


@dataclasses.dataclass
class _Candidate:
    """K micro-batches (cost order is decided by ``_deal``) and where dealing put them."""

    groups: List[np.ndarray]  # positions into the step's samples; may hold fewer than W x M (the rest: ghosts)
    costs: np.ndarray  # (len(groups),) their group costs (planning precision)
    micro_steps: int
    rank_of: np.ndarray = None  # (len(groups),)
    slot_of: np.ndarray = None
    slowest: float = math.inf  # the slowest rank's cost (DDP's step time)
    meet: float = math.inf  # sum over micro-steps of the costliest micro-batch plus overhead (FSDP's step time)
    runs: Optional[List[Tuple[int, int]]] = None  # padded: the first len(runs) groups as runs of the sorted samples


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
    totals = np.full(world, m * overhead)
    exact = group_cost(cand.groups, cand.costs)
    for g, r, j, c in zip(cand.groups, cand.rank_of.tolist(), cand.slot_of.tolist(), exact):
        ranks[r][j] = g
        totals[r] += c
    return GlobalStepPlan(ranks, oversize, totals, bound)


def _bound(single: np.ndarray, n_groups_lb: float, world: int, overhead: float) -> float:
    """max(S / W, s_max) + M_lb x overhead (``plan_global_step``'s docstring)."""
    if len(single) == 0:
        return 0.0
    m_lb = -(-max(1, int(math.ceil(n_groups_lb - 1e-9))) // world)
    return float(max(single.sum() / world, single.max()) + m_lb * overhead)


# --------------------------------------------------------------------------- padded layout


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
        if self.fast:
            self.g = pad[:, 0].astype(np.int64)
            self.g_list = self.g.tolist()
            change = np.flatnonzero(np.diff(self.g)) + 1
            self.b_start = np.concatenate(([0], change)).astype(np.int64)
            self.b_end = np.concatenate((change, [self.n])).astype(np.int64)
            self.b_g = self.g[self.b_start]
            self.b_fit = cost.copies_that_fit_unrounded(pad[self.b_start])  # not cut short by the samples left
        else:
            # levels[l][i] = max of pad[i : i + 2**l] per dimension (cut at n): two overlapping levels cover a run
            levels = [pad.astype(np.float64)]
            while (1 << len(levels)) <= max(int(self.cnt.max(initial=1)), 1):
                half = 1 << (len(levels) - 1)
                nxt = levels[-1].copy()
                nxt[:self.n - half] = np.maximum(nxt[:self.n - half], nxt[half:])
                levels.append(nxt)
            self.table = [np.ascontiguousarray(np.stack(levels)[:, :, d]).ravel() for d in range(dims)]
            self.table_lists = [t.tolist() for t in self.table]
            self.cum_extra = None if extra is None else np.concatenate(([0.0], np.cumsum(extra)))
            self.cum_extra_list = None if extra is None else self.cum_extra.tolist()
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
        out = np.zeros(len(s))
        for table in self.table:
            out += np.maximum(table.take(first), table.take(second))
        out *= size
        if self.cum_extra is not None:
            out = out + (self.cum_extra[e] - self.cum_extra[s])
        return out

    def cost_of(self, s: int, e: int) -> float:
        """``cost`` of one run [s, e), in Python scalars."""
        size = e - s
        if self.fast:
            return float(size * self.g_list[s])
        level = size.bit_length() - 1
        first, second = level * self.n + s, level * self.n + e - (1 << level)
        out = sum(max(table[first], table[second]) for table in self.table_lists) * size
        return out + (self.cum_extra_list[e] - self.cum_extra_list[s] if self.cum_extra is not None else 0.0)

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
            g, cnt, c = self.g_list, self.cnt_list, int(math.floor(cap + 1e-9))
            while i < n:
                step = c // g[i]
                if step > cnt[i]:
                    step = cnt[i]
                if step <= 0:
                    return math.inf
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
        b = int(np.searchsorted(self.b_start, i, side="right")) - 1
        g, fit = self.b_g[b:], self.b_fit[b:]
        step = np.minimum(np.floor(cap / g + 1e-9), fit)
        if self.mult > 1:
            step = np.where(fit >= self.mult, step - step % self.mult, step)
        if step.min() <= 0:
            return math.inf
        size = (self.b_end[b:] - self.b_start[b:]).astype(np.float64)
        size[0] = self.b_end[b] - i
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
                 side: Optional[np.ndarray], alone: bool, fsdp: Optional[bool]) -> GlobalStepPlan:
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

    def candidate(runs: List[Tuple[int, int]], m: int) -> _Candidate:
        costs = runs_of.cost(np.array([s for s, _ in runs]), np.array([e for _, e in runs])).tolist() if runs else []
        runs, costs = _fill_by_splits(runs, costs, world * m - a, runs_of.split) if runs else (runs, costs)
        keyed = sorted(zip(runs, costs))  # runs in sample order: the candidate does not depend on split order
        groups = [order[s:e] for (s, e), _ in keyed] + fixed_groups
        cand = _Candidate(groups, np.array([c for _, c in keyed] + fixed_costs, dtype=np.float64), m,
                          runs=[r for r, _ in keyed])
        return _evaluate(cand, world, overhead, fsdp)

    def complemented(runs: List[Tuple[int, int]], last_start: int, m: int, limit: float) -> Optional[_Candidate]:
        """The runs before ``last_start`` dealt over m - 1 micro-steps, then the last micro-step cut to even out
        the ranks' totals (``_Runs.complement``), none of its runs costlier than the costliest of the plain cut's
        last micro-step (FSDP waits for it)."""
        head = [r for r in runs if r[0] < last_start]
        tail = [r for r in runs if r[0] >= last_start]
        if not tail or len(head) + a != world * (m - 1):
            return None
        run_cap = float(runs_of.cost(np.array([s for s, _ in tail]), np.array([e for _, e in tail])).max()) \
            if protect else math.inf
        head_costs = runs_of.cost(np.array([s for s, _ in head]), np.array([e for _, e in head])).tolist()
        costs = np.array(head_costs + fixed_costs, dtype=np.float64)
        rank_of, slot_of, totals = _deal(costs, world, m - 1, 0.0)
        last = runs_of.complement(last_start, totals, limit - m * overhead, run_cap)
        if last is None:
            return None
        tail, ranks = last
        tail_costs = runs_of.cost(np.array([s for s, _ in tail]), np.array([e for _, e in tail]))
        h = len(head)
        groups = [order[s:e] for s, e in head + tail] + fixed_groups
        cand = _Candidate(groups, np.concatenate((costs[:h], tail_costs, costs[h:])), m,
                          np.concatenate((rank_of[:h], ranks, rank_of[h:])),
                          np.concatenate((slot_of[:h], np.full(world, m - 1), slot_of[h:])), runs=head + tail)
        return _score(cand, world, overhead)

    def polish(cand: _Candidate) -> _Candidate:
        """The candidate after ``_improve`` (its groups follow its runs)."""
        if world == 1 or (cand.micro_steps == 1 and len(cand.groups) == world):
            return cand  # one micro-batch per rank: the min-max cut is as good as moves get
        cand = _improve(cand, runs_of, world, overhead, protect)
        cand.groups[:len(cand.runs)] = [order[s:e] for s, e in cand.runs]
        return cand

    best: Optional[_Candidate] = None
    if n == 0:
        m = -(-a // world)
        best = candidate([], m)
    else:
        min_runs = int(runs_of.count(0, math.inf, n))
        m0 = max(1, -(-(min_runs + a) // world))
        m_max = max(m0, n + a)  # past ceil((n + a) / W) some ranks run ghosts: a few M more, while they may win
        misses = 0
        for m in range(m0, m_max + 1):
            if best is not None and lb_total + m * overhead >= _primary(best, fsdp) - 1e-9:
                break
            sizes = _slot_sizes(world, m, a)
            cut = runs_of.slot_cut(sizes)
            if cut is None:
                continue
            cand = candidate(cut[0], m)
            if m > 1 and sizes[-1] == world and (runs_of.fast or world <= _SMALL_WORLD):
                other = complemented(cut[0], cut[1], m, cand.slowest)
                cand = other if _better(cand, other, fsdp) else cand
            cand = polish(cand)
            if _better(best, cand, fsdp):
                best, misses = cand, 0
            else:
                misses += 1
                if misses >= _MAX_TRIES:
                    break
        if world == 1 or n <= _SMALL_STEP:  # the least-cost cut of odb.plan.step_cut, dealt
            for scale in ((1.0,) if world == 1 else (1.0, 0.5, 0.0)):
                runs = least_cost_segments(pool.padded, runs_of.cnt, cost, overhead * scale, pool.patches)
                m = max(1, -(-(len(runs) + a) // world))
                cand = polish(candidate(runs, m))
                if _better(best, cand, fsdp):
                    best = cand
    return _emit(best, world, oversize, bound, group_cost, overhead)


def _improve(cand: _Candidate, runs_of: _Runs, world: int, overhead: float, protect: bool) -> _Candidate:
    """Local search on the slowest rank (at most ``_IMPROVE_STEPS`` moves, each strictly lowering it below
    the old maximum): move samples from one of its runs to the neighbouring run (in the sorted order) of the same
    or another rank, swap one of its runs with a cheaper one of the same micro-step on another rank, or hand a
    run to a ghost of another rank (of the same micro-step if it has one). Every run keeps a sample (no ghost
    appears) and stays feasible; with ``protect`` no micro-step's costliest micro-batch gets costlier (FSDP
    waits for it)."""
    runs = list(cand.runs)
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
            peers = np.flatnonzero((slot == slot[t]) & (rank != top))
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
    cand = dataclasses.replace(cand, costs=costs, rank_of=rank, slot_of=slot, runs=runs,
                               groups=list(cand.groups))
    return _score(cand, world, overhead)


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


# --------------------------------------------------------------------------- packed layout


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
                 side: Optional[np.ndarray], alone: bool, fsdp: Optional[bool]) -> GlobalStepPlan:
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
    while m <= n + a:
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
        elif k > 0:  # best-fit decreasing rows (odb.plan.packing), split up to k rows
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


# --------------------------------------------------------------------------- efficiency


def step_efficiency(lengths: np.ndarray, plan: GlobalStepPlan, cost: CostModel, overhead: float
                    ) -> Tuple[float, float]:
    """(DDP, FSDP) efficiency of a planned step: the ideal step time over the planned one, in tokens.

    Ideal: the step's real tokens (of the planned samples) spread evenly over the W ranks, in one micro-batch
    each: ``real / W + overhead``. DDP waits for the slowest rank at the step's all-reduce:
    ``max over ranks r of (sum over j of padded(r, j)) + M x overhead``. FSDP meets at every micro-step:
    ``sum over j of max over r of (padded(r, j) + overhead)``. ``padded(r, j)`` is ``cost.group_tokens`` of rank
    r's micro-batch j (B x its longest per dimension; packed: its real tokens), 0 for a ghost (which costs the
    overhead only). A plan with no micro-batch scores (1.0, 1.0).

    Example:
        >>> cost = CostModel((100,))
        >>> plan = GlobalStepPlan([[np.array([0]), np.array([2, 3])], [np.array([1]), np.empty(0, dtype=np.int64)]],
        ...                       np.empty(0, dtype=np.int64), np.zeros(2), 0.0)
        >>> step_efficiency(np.array([40, 30, 10, 5]), plan, cost, overhead=10.0)   # (85/2+10) / (60+20), / (50+20+10)
        (0.65625, 0.65625)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim == 1:
        lengths = lengths[:, None]
    world, m = len(plan.ranks), plan.micro_steps
    if world == 0 or m == 0:
        return 1.0, 1.0
    padded = np.zeros((world, m))
    real = 0
    for r, groups in enumerate(plan.ranks):
        for j, g in enumerate(groups):
            if len(g):
                padded[r, j] = cost.group_tokens(lengths[g])
                real += int(lengths[g].sum())
    ideal = real / world + overhead
    ddp = ideal / (float(padded.sum(axis=1).max()) + m * overhead)
    fsdp = ideal / float((padded + overhead).max(axis=0).sum())
    return float(ddp), float(fsdp)
