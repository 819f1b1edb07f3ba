"""Property and example tests of the pure planning core (planner.py, window.py).

Feasibility is re-checked here from the definitions in docs/algorithm.md (B x padded L per
dimension, optional L * (1 + L / q) weight, batch size cap, image patch cap), with
exact integer arithmetic, so a planner that trusts a wrong count is caught.
"""

from __future__ import annotations

import bisect
import math

from typing import List, NamedTuple, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odb.bench.workloads import LOGNORMAL, lognormal_lengths
from odb.config import ODBConfig
from odb.plan.costs.cost import CostModel
from odb.plan.windows.planner import _dp_segments, _max_counts_sorted, greedy_segments, plan_window, sort_order
from odb.plan.windows.window import WindowPlanner, flatten, oracle_groups, plan_stream

PROPERTY = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class Setup(NamedTuple):
    cfg: ODBConfig
    lengths: np.ndarray  # (n,) or (n, D) as handed to the planner
    patches: Optional[np.ndarray]

    @property
    def rows(self) -> np.ndarray:
        return self.lengths[:, None] if self.lengths.ndim == 1 else self.lengths


@st.composite
def configs(draw):
    """(config, dims): 1 or 2 dims, summed or per-dimension budget, every cap."""
    dims = draw(st.sampled_from([1, 2]))
    if dims == 2 and draw(st.booleans()):
        budget = (draw(st.integers(16, 300)), draw(st.integers(16, 300)))
    else:
        budget = draw(st.integers(16, 600))
    multiple = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
    use_patches = draw(st.booleans())
    return ODBConfig(
        token_budget=budget,
        buffer_size=draw(st.integers(1, 40)),
        max_carry=draw(st.one_of(st.none(), st.integers(0, 25))),
        pack_efficiency=draw(st.one_of(st.none(), st.floats(0.3, 1.0))),  # None: the default, with the ramp-up rule
        pad_to_multiple_of=draw(st.sampled_from([1, 1, 2, 8])),
        batch_size_multiple=multiple,
        max_batch_size=draw(st.one_of(st.none(), st.integers(multiple, 3 * multiple + 8))),
        quadratic_length=draw(st.one_of(st.none(), st.integers(4, 512))),
        image_patches_key="patches" if use_patches else None,
        max_image_patches=draw(st.integers(1, 40)) if use_patches else None,
    ), dims


@st.composite
def setups(draw, max_n: int = 60) -> Setup:
    cfg, dims = draw(configs())
    n = draw(st.integers(0, max_n))
    top = max(cfg.token_budgets)
    # Mostly short samples (batches of several), some long ones, a few oversize.
    length = st.one_of(st.integers(1, max(2, top // 10)), st.integers(1, top // 2), st.integers(1, top + top // 4))
    lengths = np.array(draw(st.lists(st.lists(length, min_size=dims, max_size=dims), min_size=n, max_size=n)),
                       dtype=np.int64).reshape(n, dims)
    if dims == 1 and draw(st.booleans()):
        lengths = lengths[:, 0]
    patches = None
    if cfg.max_image_patches is not None:
        patches = np.array(draw(st.lists(st.integers(0, cfg.max_image_patches + 5), min_size=n, max_size=n)),
                           dtype=np.int64)
    return Setup(cfg, lengths, patches)


def fits(cfg: ODBConfig, rows: np.ndarray, patches: Optional[np.ndarray], at_budget: bool = True) -> bool:
    """Whether these samples (rows of real lengths) may form one batch, in exact integers.

    at_budget=False refuses a quadratic-weight batch that costs exactly the budget: the
    planner's float weights may land one ulp above it (see test_cost.py), so there both
    answers are accepted from the planner; never a batch above the budget.
    """
    b = len(rows)
    if cfg.max_batch_size is not None and b > cfg.max_batch_size:
        return False
    if patches is not None and int(np.sum(patches)) > cfg.max_image_patches:
        return False
    m = cfg.pad_to_multiple_of
    top = [-(-int(x) // m) * m for x in np.max(rows, axis=0)]
    q = cfg.quadratic_length
    # weight L*(1 + L/q) = L*(q + L)/q: compare b * weight * q with budget * q.
    weights_q = [L * (q + L) if q else L for L in top]
    scale = q or 1
    le = (lambda x, y: x <= y) if at_budget or not q else (lambda x, y: x < y)
    if len(cfg.token_budgets) == 1:
        return le(b * sum(weights_q), cfg.token_budget * scale)
    return all(le(b * w, budget * scale) for w, budget in zip(weights_q, cfg.token_budgets))


def assert_within_budget(cfg: ODBConfig, rows: np.ndarray, patches: Optional[np.ndarray], group) -> None:
    cost = CostModel.from_config(cfg)
    padded = cost.pad(rows[group])
    budgets = cfg.token_budgets
    if len(budgets) == 1:
        assert cost.batch_cost(padded) <= budgets[0]
    else:
        for d, budget in enumerate(budgets):
            assert cost.batch_cost(padded[:, [d]]) <= budget
    if cfg.max_batch_size is not None:
        assert len(group) <= cfg.max_batch_size
    if patches is not None:
        assert int(patches[group].sum()) <= cfg.max_image_patches
    assert fits(cfg, rows[group], None if patches is None else patches[group])


BAND_EDGES = sorted({math.ceil(2 ** (k / 4)) for k in range(252)})  # bands of total length, 4 per octave


def order_key(padded_row, sample_id: int) -> tuple:
    """The planner's order, written out: one dimension by decreasing length; several by decreasing band of
    total length, then the first dimension's share (rising in odd bands, falling in even ones), then
    decreasing total; ties by id."""
    total = int(sum(padded_row))
    if len(padded_row) == 1:
        return (-total, sample_id)
    band = bisect.bisect_right(BAND_EDGES, max(total, 1))
    share = padded_row[0] / max(total, 1)
    return (-band, -share if band % 2 == 0 else share, -total, sample_id)


def sorted_positions(cfg: ODBConfig, rows: np.ndarray, ids: np.ndarray, keep: np.ndarray) -> List[int]:
    """Pool positions in the planner's order (``order_key``)."""
    m = cfg.pad_to_multiple_of
    padded = -(-rows // m) * m
    return sorted((int(i) for i in keep), key=lambda i: order_key([int(v) for v in padded[i]], int(ids[i])))


def test_sort_order_of_two_lengths_goes_down_bands_of_total_by_how_they_split() -> None:
    # totals 48 and 49 are in band 18 (even: the first dimension's share falls) and come first; totals
    # 40, 40, 40, 41 share band 17 (odd: it rises), so the run crossing the band edge meets a similar split.
    rows = np.array([[10, 30], [30, 10], [20, 20], [11, 30], [12, 36], [36, 13]])
    assert sort_order(rows, np.arange(6)).tolist() == [5, 4, 0, 3, 2, 1]
    assert [bisect.bisect_right(BAND_EDGES, t) for t in (40, 41, 48, 49)] == [17, 17, 18, 18]
    # one dimension: decreasing length, ties by id
    assert sort_order(np.array([[3], [9], [5], [9]]), np.array([3, 2, 1, 0])).tolist() == [3, 1, 2, 0]


def longest_feasible_run(cfg: ODBConfig, rows, patches, order: List[int], start: int, at_budget: bool = True) -> int:
    k = 1
    while start + k < len(order):
        run = order[start:start + k + 1]
        if not fits(cfg, rows[run], None if patches is None else patches[run], at_budget):
            break
        k += 1
    return k


def assert_oversize_exactly(cfg: ODBConfig, rows: np.ndarray, patches: Optional[np.ndarray], reported) -> None:
    """The reported oversize samples are those that do not fit alone (up to the boundary above)."""
    def alone(i: int, at_budget: bool) -> bool:
        return fits(cfg, rows[[i]], None if patches is None else patches[[i]], at_budget)
    reported = {int(i) for i in reported}
    assert {i for i in range(len(rows)) if not alone(i, True)} <= reported
    assert reported <= {i for i in range(len(rows)) if not alone(i, False)}


def run_plan(s: Setup, ids: np.ndarray, final: bool, carry_limit: int):
    cost = CostModel.from_config(s.cfg)
    return plan_window(s.lengths, ids, cost, final=final, pack_efficiency=s.cfg.emit_efficiency,
                       carry_limit=carry_limit, patches=s.patches)


def as_sets(plan, ids=None):
    key = (lambda g: frozenset(g.tolist())) if ids is None else (lambda g: frozenset(ids[g].tolist()))
    return {key(g) for g in plan.groups}


# --------------------------------------------------------------------------- plan_window


@PROPERTY
@given(s=setups(), final=st.booleans(), carry_limit=st.integers(0, 30))
def test_plan_window_partitions_pool_and_respects_every_cap(s: Setup, final: bool, carry_limit: int) -> None:
    n = len(s.rows)
    plan = run_plan(s, np.arange(n), final, carry_limit)
    parts = [g.tolist() for g in plan.groups] + [plan.carry.tolist(), plan.oversize.tolist()]
    flat = [int(i) for p in parts for i in p]
    assert sorted(flat) == list(range(n))  # every sample exactly once
    assert all(len(g) >= 1 for g in plan.groups)
    assert_oversize_exactly(s.cfg, s.rows, s.patches, plan.oversize)
    if final:
        assert len(plan.carry) == 0
    else:
        assert len(plan.carry) <= carry_limit
    for g in plan.groups:
        assert_within_budget(s.cfg, s.rows, s.patches, g)


@PROPERTY
@given(s=setups(), final=st.booleans(), carry_limit=st.integers(0, 30))
def test_batch_size_multiple_only_breaks_below_the_multiple(s: Setup, final: bool, carry_limit: int) -> None:
    m = s.cfg.batch_size_multiple
    plan = run_plan(s, np.arange(len(s.rows)), final, carry_limit)
    for g in plan.groups:
        assert len(g) % m == 0 or len(g) < m


@PROPERTY
@given(s=setups())
def test_final_window_is_the_greedy_cut_of_the_sorted_pool(s: Setup) -> None:
    """Exact rule of greedy_segments + round_to_multiple: from each start, the longest
    feasible run c; take c rounded down to the multiple when c >= multiple, else c."""
    ids = np.arange(len(s.rows))[::-1].copy()  # ids differ from positions
    plan = run_plan(s, ids, True, 0)
    m = s.cfg.batch_size_multiple
    keep = np.setdiff1d(np.arange(len(s.rows)), plan.oversize)
    order = sorted_positions(s.cfg, s.rows, ids, keep)
    assert [int(i) for g in plan.groups for i in g] == order
    start = 0
    for g in plan.groups:
        lo = longest_feasible_run(s.cfg, s.rows, s.patches, order, start, at_budget=False)
        hi = longest_feasible_run(s.cfg, s.rows, s.patches, order, start)
        assert len(g) in {c - c % m if c >= m else c for c in range(lo, hi + 1)}
        start += len(g)


@PROPERTY
@given(s=setups())
def test_dp_groups_break_the_multiple_only_when_budget_or_pool_forbids_it(s: Setup) -> None:
    """With no carry pressure every group comes from the DP: a size that is not a
    multiple means the m samples from its first one do not fit, or fewer than m remain."""
    n = len(s.rows)
    m = s.cfg.batch_size_multiple
    ids = np.arange(n)
    plan = run_plan(s, ids, False, n)
    keep = np.setdiff1d(np.arange(n), plan.oversize)
    order = sorted_positions(s.cfg, s.rows, ids, keep)
    pos = {p: k for k, p in enumerate(order)}
    for g in plan.groups:
        k = pos[int(g[0])]
        run = order[k:k + len(g)]
        assert sorted(run) == sorted(g.tolist())  # a run of neighbours in sorted order
        if len(g) % m:
            assert len(g) < m
            nxt = order[k:k + m]
            assert len(nxt) < m or not fits(s.cfg, s.rows[nxt], None if s.patches is None else s.patches[nxt], False)


@PROPERTY
@given(s=setups(), final=st.booleans(), carry_limit=st.integers(0, 30))
def test_plan_window_is_deterministic(s: Setup, final: bool, carry_limit: int) -> None:
    ids = np.arange(len(s.rows))
    a = run_plan(s, ids, final, carry_limit)
    b = run_plan(s, ids, final, carry_limit)
    assert [g.tolist() for g in a.groups] == [g.tolist() for g in b.groups]
    assert a.carry.tolist() == b.carry.tolist()
    assert a.oversize.tolist() == b.oversize.tolist()


@PROPERTY
@given(s=setups(), final=st.booleans(), carry_limit=st.integers(0, 30), data=st.data())
def test_groups_do_not_depend_on_pool_order(s: Setup, final: bool, carry_limit: int, data) -> None:
    n = len(s.rows)
    ids = np.array(data.draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n, unique=True)), dtype=np.int64)
    perm = np.array(data.draw(st.permutations(range(n))), dtype=np.int64)
    a = run_plan(s, ids, final, carry_limit)
    shuffled = Setup(s.cfg, s.lengths[perm], None if s.patches is None else s.patches[perm])
    b = run_plan(shuffled, ids[perm], final, carry_limit)
    assert as_sets(a, ids) == as_sets(b, ids[perm])
    assert set(ids[a.carry].tolist()) == set(ids[perm][b.carry].tolist())
    assert set(ids[a.oversize].tolist()) == set(ids[perm][b.oversize].tolist())


def test_plan_window_docstring_example_and_group_order() -> None:
    plan = plan_window(np.array([50, 50, 10, 10]), np.arange(4), CostModel((100,)), final=True)
    assert [g.tolist() for g in plan.groups] == [[0, 1], [2, 3]]
    assert plan.carry.size == 0 and plan.oversize.size == 0


def test_empty_and_all_oversize_pools() -> None:
    cm = CostModel((100,))
    empty = plan_window(np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64), cm, final=False)
    assert empty.groups == [] and empty.carry.size == 0 and empty.oversize.size == 0
    over = plan_window(np.array([101, 500]), np.array([7, 8]), cm, final=True)
    assert over.groups == [] and over.oversize.tolist() == [0, 1]


def test_oversize_sample_is_reported_and_others_still_batched() -> None:
    plan = plan_window(np.array([30, 120, 30, 40]), np.arange(4), CostModel((100,)), final=True)
    assert plan.oversize.tolist() == [1]
    assert all(1 not in g.tolist() for g in plan.groups)
    # Sorted 40, 30, 30: the 40 takes one 30 (2 x 40 = 80), the other 30 goes alone.
    assert [sorted(g.tolist()) for g in plan.groups] == [[0, 3], [2]]


def test_pad_to_multiple_of_changes_the_cut() -> None:
    lengths = np.full(8, 9)
    plain = plan_window(lengths, np.arange(8), CostModel((64,)), final=True)
    padded = plan_window(lengths, np.arange(8), CostModel((64,), pad_to_multiple_of=8), final=True)
    assert [len(g) for g in plain.groups] == [7, 1]  # 7 x 9 = 63
    assert [len(g) for g in padded.groups] == [4, 4]  # 9 pads to 16: 4 x 16 = 64


def test_quadratic_length_shrinks_batches() -> None:
    lengths = np.full(12, 100)
    linear = plan_window(lengths, np.arange(12), CostModel((1000,)), final=True)
    quad = plan_window(lengths, np.arange(12), CostModel((1000,), quadratic_length=100), final=True)
    assert [len(g) for g in linear.groups] == [10, 2]
    assert [len(g) for g in quad.groups] == [5, 5, 2]  # each token weighs 1 + 100/100 = 2


def test_batch_size_multiple_rounds_down_then_falls_back() -> None:
    # 11 copies fit under the budget; multiple 4 takes 8, then 3 remain (fewer than 4).
    plan = plan_window(np.full(11, 10), np.arange(11), CostModel((110,), batch_size_multiple=4), final=True)
    assert [len(g) for g in plan.groups] == [8, 3]
    # Only 3 copies of 30 fit: below the multiple the budget wins.
    plan = plan_window(np.full(5, 30), np.arange(5), CostModel((100,), batch_size_multiple=4), final=True)
    assert [len(g) for g in plan.groups] == [3, 2]


def test_image_patch_cap_limits_batches() -> None:
    cm = CostModel((10_000,), max_patches=10)
    plan = plan_window(np.full(6, 10), np.arange(6), cm, final=True, patches=np.array([4, 4, 4, 4, 4, 11]))
    assert plan.oversize.tolist() == [5]
    assert [len(g) for g in plan.groups] == [2, 2, 1]


def test_per_dimension_budget_binds_each_dimension() -> None:
    lengths = np.array([[10, 40]] * 4)
    summed = plan_window(lengths, np.arange(4), CostModel((200,)), final=True)
    per_dim = plan_window(lengths, np.arange(4), CostModel((200, 80)), final=True)
    assert [len(g) for g in summed.groups] == [4]  # 4 x 50 = 200
    assert [len(g) for g in per_dim.groups] == [2, 2]  # target: 2 x 40 = 80


def test_check_dims_mismatch_raises() -> None:
    with pytest.raises(ValueError, match="Fix"):
        plan_window(np.ones((3, 3), dtype=np.int64), np.arange(3), CostModel((10, 10)), final=True)


def test_greedy_segments_rule() -> None:
    assert greedy_segments(np.array([5, 4, 3, 2, 1]), 1) == [(0, 5)]
    assert greedy_segments(np.array([2, 2, 2, 1]), 1) == [(0, 2), (2, 4)]
    assert greedy_segments(np.array([6, 5, 4, 3, 2, 1]), 4) == [(0, 4), (4, 6)]
    assert greedy_segments(np.array([3, 3, 3]), 4) == [(0, 3)]
    assert greedy_segments(np.array([0, 1]), 2) == [(0, 1), (1, 2)]  # never an empty batch


def test_non_final_window_carries_poorly_packed_samples() -> None:
    # Nine samples of 10 under budget 100: a batch of 9 fills 90% < 95% of a full one (10).
    cm = CostModel((100,))
    plan = plan_window(np.full(9, 10), np.arange(9), cm, final=False, pack_efficiency=0.95, carry_limit=20)
    assert plan.groups == [] and sorted(plan.carry.tolist()) == list(range(9))
    plan = plan_window(np.full(10, 10), np.arange(10), cm, final=False, pack_efficiency=0.95, carry_limit=20)
    assert [len(g) for g in plan.groups] == [10] and plan.carry.size == 0
    # With too small a carry limit the best packed carried runs are emitted anyway.
    plan = plan_window(np.full(9, 10), np.arange(9), cm, final=False, pack_efficiency=0.95, carry_limit=2)
    assert len(plan.carry) <= 2 and sum(len(g) for g in plan.groups) + len(plan.carry) == 9


def test_carry_drain_emits_the_best_packed_run_first() -> None:
    # pack_efficiency=1.0: the DP emits nothing here, so the drain decides. Carried runs
    # cut greedily: (50, 30) fills 80/100, (30, 10) fills 40/90: the first goes.
    cm = CostModel((100,))
    plan = plan_window(np.array([50, 30, 30, 10]), np.arange(4), cm, final=False, pack_efficiency=1.0,
                       carry_limit=2)
    assert [g.tolist() for g in plan.groups] == [[0, 1]]
    assert sorted(plan.carry.tolist()) == [2, 3]


def test_a_run_that_exactly_reaches_pack_efficiency_is_emitted() -> None:
    plan = plan_window(np.full(10, 10), np.arange(10), CostModel((100,)), final=False, pack_efficiency=1.0,
                       carry_limit=50)
    assert [len(g) for g in plan.groups] == [10]


# --------------------------------------------------------------------------- the DP against its reference


def reference_dp_segments(tokens: np.ndarray, counts: np.ndarray, ideal: np.ndarray, efficiency: float,
                          multiple: int) -> List[tuple]:
    """The planner's DP as first written: every allowed run length tried at every start, O(n x batch)."""
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
        if vals[k] >= best[i] - 1e-6:
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


def dp_value(segs: List[tuple], tokens: np.ndarray, ideal: np.ndarray, efficiency: float) -> float:
    return sum(float(tokens[s:e].sum()) / efficiency - float(ideal[s]) for s, e in segs)


def assert_allowed_runs(segs: List[tuple], counts: np.ndarray, multiple: int) -> None:
    last = 0
    for s, e in segs:
        assert last <= s < e <= s + counts[s]
        assert (e - s) % multiple == 0 or counts[s] < multiple
        last = e


@st.composite
def dp_inputs(draw):
    """(tokens, counts, ideal, efficiency, multiple) with the run ends i + counts[i] never
    decreasing, as counts of a sorted pool are; integer token counts as the planner has."""
    n = draw(st.integers(0, 120))
    multiple = draw(st.sampled_from([1, 1, 2, 3, 4, 8]))
    reach = np.array(draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)), dtype=np.int64)
    ends = np.maximum.accumulate(np.minimum(np.arange(n) + reach, n)) if n else reach
    counts = ends - np.arange(n)
    tokens = np.array(draw(st.lists(st.integers(0, 60), min_size=n, max_size=n)), dtype=np.float64)
    ideal = np.array(draw(st.lists(st.integers(1, 2000), min_size=n, max_size=n)), dtype=np.float64)
    efficiency = draw(st.sampled_from([0.95, 1.0, 0.5]) | st.floats(0.3, 1.0))
    return tokens, counts, ideal, efficiency, multiple


@PROPERTY
@given(dp_inputs())
def test_sliding_window_dp_matches_the_reference_objective(args) -> None:
    tokens, counts, ideal, efficiency, multiple = args
    fast = _dp_segments(tokens, counts, ideal, efficiency, multiple)
    slow = reference_dp_segments(tokens, counts, ideal, efficiency, multiple)
    assert_allowed_runs(fast, counts, multiple)
    a, b = dp_value(fast, tokens, ideal, efficiency), dp_value(slow, tokens, ideal, efficiency)
    assert a == pytest.approx(b, rel=1e-6, abs=1e-6)


def pool_dp_inputs(cost: CostModel, rows: np.ndarray, patches: Optional[np.ndarray] = None):
    """The DP's inputs for a pool of (n, D) lengths, as plan_window builds them."""
    padded = cost.pad(rows)
    fit = cost.copies_that_fit(padded, patches)
    ok = np.flatnonzero(fit > 0)
    order = ok[sort_order(padded[ok], ok)]
    counts = cost.max_counts_sorted(padded[order], None if patches is None else patches[order])
    tokens = rows[order].sum(axis=1).astype(np.float64)
    ideal = fit[order] * padded[order].sum(axis=1).astype(np.float64)
    return tokens, counts, ideal


@PROPERTY
@given(setups(max_n=120))
def test_sliding_window_dp_matches_the_reference_on_planner_pools(s: Setup) -> None:
    cost = CostModel.from_config(s.cfg)
    tokens, counts, ideal = pool_dp_inputs(cost, s.rows, s.patches)
    ends = np.arange(len(counts)) + counts
    assert (np.diff(ends) >= 0).all()  # what the sliding window relies on
    eff, m = s.cfg.emit_efficiency, cost.multiple
    fast = _dp_segments(tokens, counts, ideal, eff, m)
    slow = reference_dp_segments(tokens, counts, ideal, eff, m)
    assert_allowed_runs(fast, counts, m)
    assert dp_value(fast, tokens, ideal, eff) == pytest.approx(dp_value(slow, tokens, ideal, eff), rel=1e-6, abs=1e-6)


@pytest.mark.parametrize("name", sorted(LOGNORMAL))
@pytest.mark.parametrize("multiple", [1, 8])
def test_sliding_window_dp_plans_like_the_reference_on_benchmark_pools(name: str, multiple: int) -> None:
    mean, cv = LOGNORMAL[name]
    tokens, counts, ideal = pool_dp_inputs(CostModel((16384,), batch_size_multiple=multiple),
                                           lognormal_lengths(mean, cv, 3000, seed=1)[:, None])
    assert _dp_segments(tokens, counts, ideal, 0.95, multiple) == reference_dp_segments(tokens, counts, ideal, 0.95,
                                                                                        multiple)


@PROPERTY
@given(setups(max_n=120))
def test_fast_max_counts_equal_the_cost_models(s: Setup) -> None:
    cost = CostModel.from_config(s.cfg)
    padded = cost.pad(s.rows)
    order = sort_order(padded, np.arange(len(padded)))
    patches = None if s.patches is None else s.patches[order]
    for model in (cost, cost.scaled(0.37)):  # balanced_partition asks with scaled budgets
        assert (_max_counts_sorted(model, padded[order], patches).tolist()
                == model.max_counts_sorted(padded[order], patches).tolist())


def test_dp_ties_go_to_the_shortest_run_and_emit() -> None:
    # Empty samples add nothing: from sample 0 every run is worth 10 - 10 = 0, as much as
    # carrying. The shortest run is emitted; the empty samples alone are worth -10: carried.
    tokens, ideal = np.array([10.0, 0, 0, 0, 0]), np.full(5, 10.0)
    assert _dp_segments(tokens[:3], np.array([3, 2, 1]), ideal[:3], 1.0, 1) == [(0, 1)]
    assert _dp_segments(tokens, np.array([5, 4, 3, 2, 1]), ideal, 1.0, 2) == [(0, 2)]
    assert _dp_segments(tokens, np.array([1, 1, 1, 1, 1]), ideal, 1.0, 2) == [(0, 1)]  # below the multiple


# --------------------------------------------------------------------------- streams


class Stream(NamedTuple):
    setup: Setup
    ids: np.ndarray  # distinct, not positions
    bounds: List[int]  # window k holds arrivals bounds[k]:bounds[k+1]

    def row_of(self) -> dict:
        return {int(i): k for k, i in enumerate(self.ids)}

    def windows(self):
        """(ids, lengths, patches, final) of each arriving window."""
        s, last = self.setup, len(self.bounds) - 2
        for w, (a, b) in enumerate(zip(self.bounds[:-1], self.bounds[1:])):
            yield self.ids[a:b], s.lengths[a:b], None if s.patches is None else s.patches[a:b], w == last


@st.composite
def streams(draw) -> Stream:
    s = draw(setups(max_n=150))
    n = len(s.rows)
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=12)))
    ids = np.array(draw(st.lists(st.integers(0, 10**6), min_size=n, max_size=n, unique=True)), dtype=np.int64)
    return Stream(s, ids, [0] + cuts + [n])


@PROPERTY
@given(streams())
def test_window_planner_emits_every_sample_once_over_a_stream(stream: Stream) -> None:
    s = stream.setup
    wp = WindowPlanner(s.cfg)
    row_of = stream.row_of()
    emitted: List[int] = []
    oversize: List[int] = []
    for ids, lengths, patches, final in stream.windows():
        before = set(wp.carried_ids.tolist()) | set(ids.tolist())
        out = wp.plan(ids, lengths, patches, final=final)
        assert out.final is final
        got = [int(i) for g in out.groups for i in g] + out.oversize.tolist() + wp.carried_ids.tolist()
        assert sorted(got) == sorted(before)  # per window: pool = groups + oversize + carry
        if not final:
            assert len(wp.carried_ids) <= s.cfg.carry_limit(s.cfg.buffer_size)
        for g in out.groups:
            assert_within_budget(s.cfg, s.rows, s.patches, [row_of[int(i)] for i in g])
        emitted += [int(i) for g in out.groups for i in g]
        oversize += out.oversize.tolist()
    assert wp.carried_ids.size == 0
    assert sorted(emitted + oversize) == sorted(stream.ids.tolist())
    assert_oversize_exactly(s.cfg, s.rows, s.patches, [row_of[i] for i in oversize])


@PROPERTY
@given(setups(max_n=150))
def test_plan_stream_emits_every_sample_once_deterministically(s: Setup) -> None:
    n = len(s.rows)
    windows = list(plan_stream(s.lengths, s.cfg, s.patches))
    assert [w.final for w in windows] == [False] * (len(windows) - 1) + [True]
    assert len(windows) == max(1, -(-n // s.cfg.buffer_size))
    groups, over = flatten(windows)
    assert sorted([int(i) for g in groups for i in g] + over.tolist()) == list(range(n))
    assert_oversize_exactly(s.cfg, s.rows, s.patches, over)
    for g in groups:
        assert_within_budget(s.cfg, s.rows, s.patches, g)
    again, over2 = flatten(plan_stream(s.lengths, s.cfg, s.patches))
    assert [g.tolist() for g in again] == [g.tolist() for g in groups]
    assert over2.tolist() == over.tolist()


@PROPERTY
@given(setups(max_n=80), st.integers(1, 79))
def test_restore_carry_continues_like_the_original_planner(s: Setup, cut: int) -> None:
    n = len(s.rows)
    cut = min(cut, n)
    ids = np.arange(n)
    p = None if s.patches is None else s.patches
    first = WindowPlanner(s.cfg)
    first.plan(ids[:cut], s.lengths[:cut], None if p is None else p[:cut], final=False)
    carried = first.carried_ids
    resumed = WindowPlanner(s.cfg)
    resumed.restore_carry(carried, s.rows[carried], None if p is None else p[carried])
    a = first.plan(ids[cut:], s.lengths[cut:], None if p is None else p[cut:], final=True)
    b = resumed.plan(ids[cut:], s.lengths[cut:], None if p is None else p[cut:], final=True)
    assert [g.tolist() for g in a.groups] == [g.tolist() for g in b.groups]
    assert a.oversize.tolist() == b.oversize.tolist()


@PROPERTY
@given(streams(), st.data())
def test_deferred_groups_come_back_exactly_once(stream: Stream, data) -> None:
    """A rank that ran fewer steps than planned defers groups; they are planned again."""
    s = stream.setup
    wp = WindowPlanner(s.cfg)
    row_of = stream.row_of()
    emitted: List[int] = []
    for ids, lengths, patches, final in stream.windows():
        out = wp.plan(ids, lengths, patches, final=final)
        keep = len(out.groups) if final else data.draw(st.integers(0, len(out.groups)))
        for g in out.groups[keep:]:
            rows = [row_of[int(i)] for i in g]
            wp.defer(g, s.rows[rows], None if s.patches is None else s.patches[rows])
        emitted += [int(i) for g in out.groups[:keep] for i in g] + out.oversize.tolist()
    assert wp.carried_ids.size == 0
    assert sorted(emitted) == sorted(stream.ids.tolist())


def test_ramp_up_window_adds_its_best_carried_runs_until_it_emits_enough() -> None:
    """At the default pack_efficiency a window that would emit under FEED_SHARE of its new samples at 0.99 adds
    carried runs that reach 0.95, best first; an explicit pack_efficiency is taken as given."""
    from odb.plan.windows.window import FEED_SHARE, feed_runs

    # Sorted 50, 47, 46, 43, 30, 30, 10 x 9: no run reaches 0.99 of a full batch; at 0.95 the DP prefers
    # (47, 46) (93 / 94) to (50, 47) + (46, 43); the 30s and 10s reach neither.
    lengths = np.array([50, 47, 46, 43, 30, 30] + [10] * 9)
    planners = {}
    for name, cfg in (("default", ODBConfig(token_budget=100)),
                      ("explicit", ODBConfig(token_budget=100, pack_efficiency=0.99))):
        wp = WindowPlanner(cfg)
        wp.plan(np.array([100, 101]), np.array([50, 50]))  # one batch out: the first-batch rule is done
        planners[name] = (wp, wp.plan(np.arange(15), lengths))
    wp, out = planners["default"]
    assert [sorted(g.tolist()) for g in out.groups] == [[1, 2]]
    assert 2 < FEED_SHARE * 15  # it wanted more, but no other run reaches 0.95
    assert sorted(wp.carried_ids.tolist()) == [0] + list(range(3, 15))  # each sample once
    wp, out = planners["explicit"]
    assert out.groups == [] and sorted(wp.carried_ids.tolist()) == list(range(15))
    # best first, and only as many as asked for
    pool = np.array([[50], [48], [33], [33], [32]])  # runs (50, 48): 98 / 100 and (33, 33, 32): 98 / 99
    assert [sorted(g.tolist()) for g in feed_runs(pool, np.arange(5), CostModel((100,)), None, 1)] == [[2, 3, 4]]
    assert len(feed_runs(pool, np.arange(5), CostModel((100,)), None, 4)) == 2


def test_window_planner_docstring_example() -> None:
    wp = WindowPlanner(ODBConfig(token_budget=100, buffer_size=4))
    out = wp.plan(np.arange(4), np.array([50, 50, 10, 10]), final=True)
    assert [g.tolist() for g in out.groups] == [[0, 1], [2, 3]]
    assert wp.carried_ids.size == 0


def test_plan_stream_with_encoder_decoder_pairs() -> None:
    from odb.bench.workloads import encoder_decoder_lengths

    lengths = encoder_decoder_lengths(2000, seed=3)
    cfg = ODBConfig(token_budget=(2048, 2048), buffer_size=256, batch_size_multiple=8, pad_to_multiple_of=8)
    groups, over = flatten(plan_stream(lengths, cfg))
    assert over.size == 0
    assert sorted(int(i) for g in groups for i in g) == list(range(2000))
    for g in groups:
        assert_within_budget(cfg, lengths, None, g)
        assert len(g) % 8 == 0 or len(g) < 8


# --------------------------------------------------------------------------- quality


@pytest.mark.parametrize("name", sorted(LOGNORMAL))
def test_online_useful_fill_is_close_to_the_oracle(name: str) -> None:
    mean, cv = LOGNORMAL[name]
    lengths = lognormal_lengths(mean, cv, 5000, seed=0)
    cfg = ODBConfig(token_budget=16384, buffer_size=512)
    groups, over = flatten(plan_stream(lengths, cfg))
    oracle = oracle_groups(lengths, cfg)
    assert over.size == 0
    real = float(lengths.sum())
    online_fill = real / (len(groups) * cfg.token_budget)
    oracle_fill = real / (len(oracle) * cfg.token_budget)
    assert online_fill >= 0.95 * oracle_fill, (name, online_fill, oracle_fill)
    # A lone sample that could have shared its batch (not longer than half the budget).
    lonely = sum(1 for g in groups if len(g) == 1 and 2 * lengths[g[0]] <= cfg.token_budget)
    assert lonely / len(groups) < 0.01, (name, lonely, len(groups))
