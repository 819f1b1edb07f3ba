"""The global step planner (odb.plan.steps.global_plan): properties, brute force on small steps, the per-rank plan.

Feasibility is re-checked from the cost model's definitions (``CostModel.per_sample_cost_ok`` of a batch's
longest weights, the packed row capacity, ``max_batch_size``, the image patch cap, ``batch_size_multiple``);
rank costs from ``CostModel.group_cost``.
"""

from __future__ import annotations

import itertools
import math
from typing import Iterator, List, Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from odb.plan.costs.cost import CostModel, split_side
from odb.plan.steps.global_plan import GlobalStepPlan, plan_global_step, step_efficiency
from odb.plan.windows.planner import SortedPool, _max_counts_sorted
from odb.plan.steps.step_cut import plan_step_share

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def heavy_lengths(n: int, rng: np.random.Generator, median: float = 128.0, top: int = 1024) -> np.ndarray:
    """Heavy-tailed lengths: log-normal with this median and sigma 1, rounded, clipped to [8, top]."""
    return np.clip(np.rint(np.exp(rng.normal(np.log(median), 1.0, n))), 8, top).astype(np.int64)


def rows_of(lengths: np.ndarray) -> np.ndarray:
    return lengths[:, None] if lengths.ndim == 1 else lengths


def recomputed_costs(plan: GlobalStepPlan, lengths: np.ndarray, cost: CostModel, overhead: float,
                     side: Optional[np.ndarray]) -> np.ndarray:
    rows = rows_of(lengths)
    return np.array([sum(cost.group_cost(rows[g], None if side is None else side[g]) for g in groups if len(g))
                     + len(groups) * overhead for groups in plan.ranks])


def check_plan(plan: GlobalStepPlan, lengths: np.ndarray, world: int, cost: CostModel, overhead: float,
               side: Optional[np.ndarray], alone: bool) -> None:
    """Every property plan_global_step promises, from the definitions."""
    rows = rows_of(lengths)
    n = len(rows)
    m = plan.micro_steps
    assert len(plan.ranks) == world and all(len(groups) == m for groups in plan.ranks)
    groups = [g for gs in plan.ranks for g in gs if len(g)]
    placed = np.concatenate(groups).tolist() if groups else []
    assert len(placed) == len(set(placed)), "a sample is planned twice"
    padded = cost.pad(rows)
    over = set(np.flatnonzero(cost.copies_that_fit(padded, side) == 0).tolist())
    if alone:
        assert len(plan.oversize) == 0 and sorted(placed) == list(range(n))
        assert all(len(g) == 1 for g in groups if set(g.tolist()) & over), "a sample over the budget is not alone"
    else:
        assert sorted(plan.oversize.tolist()) == sorted(over) and sorted(placed) == sorted(set(range(n)) - over)
    patches, _ = split_side(side)
    for g in groups:
        if len(g) == 1 and int(g[0]) in over:
            continue
        s = None if side is None else side[g]
        assert len(g) <= cost.max_batch
        if patches is not None and cost.max_patches is not None:
            assert patches[g].sum() <= cost.max_patches
        if cost.packed:
            assert cost.batch_cost(padded[g], s) <= cost.row_capacity
        else:
            extra = cost.side_cost(s)
            assert cost.per_sample_cost_ok(cost.token_weight(padded[g].max(axis=0))[None, :], np.array([len(g)]),
                                           None if extra is None else np.array([extra.sum()]))[0]
    if not cost.packed and cost.multiple > 1:  # as least_cost_segments: a multiple, or the sorted order's last run
        pool = SortedPool.of(rows, np.arange(n), cost, side)
        at = np.full(n, -1)
        at[pool.order] = np.arange(len(pool.order))
        counts = _max_counts_sorted(cost, pool.padded, pool.patches)
        for g in groups:
            if len(g) % cost.multiple and not (len(g) == 1 and int(g[0]) in over):
                assert counts[at[g].min()] < cost.multiple or at[g].max() == len(pool.order) - 1
    np.testing.assert_allclose(plan.rank_costs, recomputed_costs(plan, lengths, cost, overhead, side))
    if m:
        assert plan.rank_costs.max() >= plan.bound - 1e-6
    if cost.multiple == 1 and len(placed) >= world * m:
        assert plan.ghosts == 0, "a ghost although the step has a sample for every cell"
    ddp, fsdp = step_efficiency(lengths, plan, cost, overhead)
    assert 0.0 < fsdp <= ddp + 1e-12 and ddp <= 1.0 + 1e-12


@st.composite
def steps(draw):
    n = draw(st.integers(0, 40))
    dims = draw(st.sampled_from([1, 1, 2]))
    layout = draw(st.sampled_from(["padded", "padded", "packed"]))
    budget = draw(st.sampled_from([64, 128, 300, 1000]))
    budgets = (budget,) if dims == 1 or layout == "packed" or draw(st.booleans()) else (budget, budget // 2)
    lengths = np.array(draw(st.lists(st.integers(1, 400), min_size=n * dims, max_size=n * dims)),
                       dtype=np.int64).reshape(n, dims)
    kw = dict(pad_to_multiple_of=draw(st.sampled_from([1, 1, 8])),
              quadratic_length=draw(st.sampled_from([None, None, 256])),
              max_batch_size=draw(st.sampled_from([None, None, 5])),
              batch_size_multiple=draw(st.sampled_from([1, 1, 2, 4])) if layout == "padded" else 1,
              layout=layout, sample_cost=draw(st.sampled_from([0.0, 0.0, 2.0])))
    side = None
    if draw(st.booleans()):
        patches = np.array(draw(st.lists(st.integers(0, 30), min_size=n, max_size=n)), dtype=np.int64)
        supervised = np.array(draw(st.lists(st.integers(0, 20), min_size=n, max_size=n)), dtype=np.int64)
        side = np.stack([patches, supervised], axis=1) if draw(st.booleans()) else patches
        kw.update(image_patch_cost=draw(st.sampled_from([0.0, 0.5, 1.0])),
                  loss_token_cost=draw(st.sampled_from([0.0, 0.25])),
                  max_patches=draw(st.sampled_from([None, 60])))
    cost = CostModel(budgets, **kw)
    if dims == 1 and draw(st.booleans()):
        lengths = lengths[:, 0]
    return (lengths, draw(st.integers(1, 5)), cost, draw(st.sampled_from([0.0, 4.0, 40.0])), side,
            draw(st.booleans()), draw(st.sampled_from([None, False, True])))


@PROPERTY
@given(steps())
def test_every_sample_once_within_budget_equal_micro_steps_and_deterministic(step):
    lengths, world, cost, overhead, side, alone, fsdp = step
    plan = plan_global_step(lengths, world, cost, overhead, side, alone, fsdp=fsdp)
    check_plan(plan, lengths, world, cost, overhead, side, alone)
    again = plan_global_step(lengths.copy(), world, cost, overhead, side, alone, fsdp=fsdp)
    assert [[g.tolist() for g in gs] for gs in plan.ranks] == [[g.tolist() for g in gs] for gs in again.ranks]
    assert plan.oversize.tolist() == again.oversize.tolist() and plan.bound == again.bound
    if lengths.ndim == 1:  # (n,) and (n, 1) are the same step
        column = plan_global_step(lengths[:, None], world, cost, overhead, side, alone, fsdp=fsdp)
        assert [[g.tolist() for g in gs] for gs in column.ranks] == [[g.tolist() for g in gs] for gs in plan.ranks]


# --------------------------------------------------------------------------- brute force


def set_partitions(items: List[int]) -> Iterator[List[List[int]]]:
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in set_partitions(rest):
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]
        yield [[first]] + part


def fits(cost: CostModel, lengths: np.ndarray, group: List[int]) -> bool:
    rows = cost.pad(lengths[group][:, None])
    if len(group) > cost.max_batch:
        return False
    if cost.packed:
        return cost.batch_cost(rows) <= cost.row_capacity
    return bool(cost.per_sample_cost_ok(cost.token_weight(rows.max(axis=0))[None, :], np.array([len(group)]))[0])


def optimum(lengths: np.ndarray, world: int, cost: CostModel, overhead: float) -> float:
    """The least slowest-rank cost over every plan the planner may return: every partition of the samples into
    micro-batches within the budget, every assignment of them to ranks with at most M each, every M; a ghost only
    where the step has fewer samples than the W x M cells (the planner's rule)."""
    n, best, known = len(lengths), math.inf, {}
    assignments = {}
    for part in set_partitions(list(range(n))):
        costs = []
        for g in part:
            key = tuple(sorted(g))
            if key not in known:
                known[key] = float(cost.group_cost(lengths[list(key)][:, None])) if fits(cost, lengths, list(key)) \
                    else None
            if known[key] is None:
                break
            costs.append(known[key])
        else:
            k = len(costs)
            if k not in assignments:
                a = np.array(list(itertools.product(range(world), repeat=k)), dtype=np.int64).reshape(-1, k)
                onehot = np.stack([a == r for r in range(world)], axis=1).astype(np.float64)
                assignments[k] = (onehot, onehot.sum(axis=2).max(axis=1))
            onehot, most = assignments[k]
            slowest = (onehot @ np.array(costs)).max(axis=1)
            for m in range(-(-k // world), k + 1):
                if k < min(n, world * m):  # an avoidable ghost
                    continue
                allowed = slowest[most <= m]
                if len(allowed):
                    best = min(best, float(allowed.min()) + m * overhead)
    return best


def small_steps(layout: str, count: int, seed: int):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        n = int(rng.integers(1, 8))
        budget = int(rng.choice([64, 100, 160, 400]))
        lengths = np.clip(np.rint(np.exp(rng.normal(np.log(12), 0.9, n))), 1, budget).astype(np.int64)
        yield lengths, int(rng.integers(1, 4)), CostModel((budget,), layout=layout), float(rng.choice([0, 3, 10, 40]))


def worst_ratio(layout: str, count: int, seed: int, fsdp: Optional[bool]) -> float:
    worst = 1.0
    for lengths, world, cost, overhead in small_steps(layout, count, seed):
        plan = plan_global_step(lengths, world, cost, overhead, fsdp=fsdp)
        best = optimum(lengths, world, cost, overhead)
        assert best >= plan.bound - 1e-9  # the bound holds for the optimum too
        worst = max(worst, float(plan.rank_costs.max()) / best)
    return worst


@pytest.mark.parametrize("layout, fsdp, factor", [("padded", False, 1.08), ("padded", None, 1.12),
                                                  ("packed", None, 1.08)])
def test_slowest_rank_near_the_brute_force_optimum(layout, fsdp, factor):
    """The slowest rank against the optimum over all plans without an avoidable ghost, on 200 random steps of 1
    to 7 samples, 1 to 3 ranks, budgets 64..400, overheads 0..40. Observed worst ratio on these steps: padded
    1.051 (fsdp=False: the slowest rank alone) and 1.099 (default: no micro-step made costlier to even out the
    ranks), packed 1.053. Over 1,200 other such steps: padded 1.061 / 1.065, packed 1.121; against the optimum
    that may also give a rank a ghost it could avoid (the planner splits a micro-batch instead), padded
    default 1.104."""
    assert worst_ratio(layout, 200, 7, fsdp) <= factor


# --------------------------------------------------------------------------- against the per-rank plan


def per_rank_slowest(lengths: np.ndarray, world: int, cost: CostModel, overhead: float) -> float:
    """Each rank cuts its own consecutive share (plan_step_share); all run the most micro-batches (ghosts)."""
    share = len(lengths) // world
    plans = [plan_step_share(lengths[r * share:(r + 1) * share], np.arange(share), cost, overhead)
             for r in range(world)]
    m = max(len(p.groups) for p in plans)
    return max(sum(cost.group_cost(lengths[r * share + g][:, None]) for g in p.groups) + m * overhead
               for r, p in enumerate(plans))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_global_plan_beats_the_per_rank_plan(layout):
    """8 ranks x 16 heavy-tailed samples (budget 4096, overhead 256), 30 steps: the global plan's slowest rank is
    below the per-rank plan's in every step (per-rank / global measured: median 1.51 padded, 1.42 packed;
    smallest 1.31 and 1.14)."""
    rng = np.random.default_rng(3)
    cost = CostModel((4096,), layout=layout)
    ratios = []
    for _ in range(30):
        lengths = heavy_lengths(128, rng)
        plan = plan_global_step(lengths, 8, cost, 256.0)
        ratios.append(per_rank_slowest(lengths, 8, cost, 256.0) / float(plan.rank_costs.max()))
    assert np.median(ratios) >= 1.2 and min(ratios) >= 1.0


def test_the_modes_trade_ddp_for_fsdp():
    """fsdp=False puts the slowest rank first, fsdp=True the micro-steps: each wins its own efficiency on average
    (8 ranks x 16 heavy-tailed samples, 20 steps), and the default sits between them. Measured (DDP, FSDP):
    False 0.845 / 0.769, default 0.839 / 0.805, True 0.832 / 0.813."""
    rng = np.random.default_rng(5)
    cost = CostModel((4096,))
    scores = {mode: [] for mode in (False, None, True)}
    for _ in range(20):
        lengths = heavy_lengths(128, rng)
        for mode in scores:
            scores[mode].append(step_efficiency(lengths, plan_global_step(lengths, 8, cost, 256.0, fsdp=mode),
                                                cost, 256.0))
    ddp = {mode: np.mean([s[0] for s in v]) for mode, v in scores.items()}
    fsdp = {mode: np.mean([s[1] for s in v]) for mode, v in scores.items()}
    assert ddp[False] >= ddp[None] - 1e-9 and ddp[False] >= ddp[True] - 1e-9
    assert fsdp[True] >= fsdp[None] - 0.01 and fsdp[None] >= fsdp[False] - 1e-9


# --------------------------------------------------------------------------- examples


def test_one_rank_is_the_least_cost_cut():
    rng = np.random.default_rng(0)
    lengths = heavy_lengths(40, rng, median=40, top=300)
    cost = CostModel((1000,))
    plan = plan_global_step(lengths, 1, cost, 30.0)
    share = plan_step_share(lengths, np.arange(40), cost, 30.0)
    assert plan.rank_costs[0] == sum(cost.group_cost(lengths[g][:, None]) + 30.0 for g in share.groups)


def test_samples_over_the_budget_are_oversize_or_alone():
    lengths = np.array([60, 10, 10, 10, 10, 10, 200, 150])
    cost = CostModel((100,))
    plan = plan_global_step(lengths, 2, cost, 5.0)
    assert plan.oversize.tolist() == [6, 7]
    check_plan(plan, lengths, 2, cost, 5.0, None, False)
    alone = plan_global_step(lengths, 2, cost, 5.0, alone=True)
    check_plan(alone, lengths, 2, cost, 5.0, None, True)
    cells = {int(g[0]): (r, len(g)) for r, gs in enumerate(alone.ranks) for g in gs if len(g)}
    assert cells[6][1] == 1 and cells[7][1] == 1 and cells[6][0] != cells[7][0]  # one each, on different ranks
    assert alone.bound >= 200 + 5.0 and alone.rank_costs.max() >= 200 + alone.micro_steps * 5.0
    everything_over = plan_global_step(np.array([500, 400]), 3, cost, 5.0)
    assert everything_over.micro_steps == 0 and everything_over.oversize.tolist() == [0, 1]


def test_a_step_with_fewer_samples_than_ranks_runs_ghosts():
    plan = plan_global_step(np.array([30, 20]), 4, CostModel((100,)), 7.0)
    assert plan.micro_steps == 1 and plan.ghosts == 2
    assert sorted(plan.rank_costs.tolist()) == [7.0, 7.0, 27.0, 37.0]
    empty = plan_global_step(np.zeros(0, dtype=np.int64), 3, CostModel((100,)), 7.0)
    assert empty.micro_steps == 0 and empty.rank_costs.tolist() == [0.0, 0.0, 0.0]


def test_packed_rows_are_balanced():
    rng = np.random.default_rng(1)
    lengths = heavy_lengths(512, rng)
    cost = CostModel((4096,), layout="packed")
    plan = plan_global_step(lengths, 32, cost, 256.0)
    check_plan(plan, lengths, 32, cost, 256.0, None, False)
    assert plan.rank_costs.max() - plan.rank_costs.min() <= lengths.max()
    assert plan.rank_costs.max() <= 1.01 * plan.bound


def test_encoder_decoder_budgets_per_dimension():
    rng = np.random.default_rng(2)
    source = heavy_lengths(96, rng, median=40, top=400)
    lengths = np.stack([source, np.clip(source + rng.integers(-10, 30, 96), 1, 400)], axis=1)
    for budgets in ((2048,), (1024, 1024)):
        cost = CostModel(budgets)
        plan = plan_global_step(lengths, 4, cost, 64.0)
        check_plan(plan, lengths, 4, cost, 64.0, None, False)
        for g in (g for gs in plan.ranks for g in gs if len(g)):
            tokens = len(g) * lengths[g].max(axis=0)
            assert (tokens <= np.array(budgets)).all() if len(budgets) == 2 else tokens.sum() <= budgets[0]


def test_image_patches_cap_and_side_costs():
    rng = np.random.default_rng(4)
    lengths = heavy_lengths(64, rng, median=60, top=500)
    side = np.stack([rng.integers(0, 40, 64), rng.integers(0, 50, 64)], axis=1)
    for layout in ("padded", "packed"):
        cost = CostModel((2000,), layout=layout, max_patches=100, image_patch_cost=2.0, loss_token_cost=0.5)
        plan = plan_global_step(lengths, 4, cost, 50.0, side)
        check_plan(plan, lengths, 4, cost, 50.0, side, False)
        assert all(side[g, 0].sum() <= 100 for gs in plan.ranks for g in gs if len(g))
        assert plan.bound >= (lengths.sum() + 2.0 * side[:, 0].sum() + 0.5 * side[:, 1].sum()) / 4 - 64


def test_batch_size_multiple_is_kept():
    rng = np.random.default_rng(6)
    lengths = heavy_lengths(90, rng, median=30, top=200)
    cost = CostModel((1024,), batch_size_multiple=4)
    plan = plan_global_step(lengths, 3, cost, 20.0)
    check_plan(plan, lengths, 3, cost, 20.0, None, False)
    sizes = [len(g) for gs in plan.ranks for g in gs if len(g)]
    assert sum(size % 4 != 0 for size in sizes) <= 1


def test_step_efficiency_counts_ghosts_as_overhead():
    cost = CostModel((100,))
    ghost = np.empty(0, dtype=np.int64)
    plan = GlobalStepPlan([[np.array([0]), np.array([1])], [np.array([2]), ghost]], ghost, np.zeros(2), 0.0)
    ddp, fsdp = step_efficiency(np.array([40, 10, 30]), plan, cost, 10.0)
    assert ddp == pytest.approx((80 / 2 + 10) / (50 + 20))
    assert fsdp == pytest.approx((80 / 2 + 10) / ((40 + 10) + (10 + 10)))


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_max_micro_steps_holds_the_loaders_messages(layout):
    """Few samples per rank, one of them long: the least slowest rank may want more micro-steps than a rank's
    share (one long sample alone on one rank, the others one by one on the other), which the loader's per-step
    messages cannot hold; ``max_micro_steps`` keeps the plan within it, every sample still planned once."""
    cost = CostModel((472,), layout=layout)
    rng = np.random.default_rng(7)
    for _ in range(200):
        world = int(rng.integers(2, 4))
        share = int(rng.integers(1, 4))
        lengths = rng.integers(50, 473, size=world * share)
        free = plan_global_step(lengths, world, cost, overhead=29.5)
        capped = plan_global_step(lengths, world, cost, overhead=29.5, max_micro_steps=share)
        assert capped.micro_steps <= share, (lengths.tolist(), free.micro_steps)
        planned = sorted(int(i) for groups in capped.ranks for g in groups for i in g)
        assert planned == list(range(len(lengths)))
    lengths = np.array([177, 143, 215, 472])  # found on the convergence benchmark's text (B = 1, 2 ranks)
    assert plan_global_step(lengths, 2, cost, overhead=29.5).micro_steps == 3
    assert plan_global_step(lengths, 2, cost, overhead=29.5, max_micro_steps=2).micro_steps == 2
