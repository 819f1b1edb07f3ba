"""odb.plan.steps.price_deal: a global step plan's micro-batches dealt to ranks again by another price
(balance="time"'s predicted seconds), keeping every micro-batch and the micro-step count."""

from __future__ import annotations

import numpy as np
import pytest

from odb.plan.steps.global_plan import GlobalStepPlan
from odb.plan.steps.price_deal import deal_by_price, planned_groups

GHOST = np.empty(0, dtype=np.int64)


def _plan(rng: np.random.Generator, world: int, m: int, ghosts: int) -> GlobalStepPlan:
    cells = world * m - ghosts
    groups = [np.array([k]) for k in range(cells)] + [GHOST] * ghosts
    rng.shuffle(groups)
    ranks = [groups[r * m:(r + 1) * m] for r in range(world)]
    return GlobalStepPlan(ranks, GHOST, np.zeros(world), 0.0)


@pytest.mark.parametrize("seed", range(20))
def test_every_micro_batch_kept_counts_equal_slowest_rank_within_the_lpt_bound(seed: int) -> None:
    rng = np.random.default_rng(seed)
    world, m = int(rng.integers(1, 6)), int(rng.integers(1, 5))
    plan = _plan(rng, world, m, int(rng.integers(0, world)))
    groups = planned_groups(plan)
    prices = rng.integers(1, 1000, size=len(groups)).astype(float)
    dealt = deal_by_price(plan, prices, prices, overhead=2.0)
    assert dealt.micro_steps == m and all(len(r) == m for r in dealt.ranks)
    assert sorted(int(g[0]) for g in planned_groups(dealt)) == sorted(int(g[0]) for g in groups)
    price_of = {int(g[0]): p for g, p in zip(groups, prices)}
    totals = [sum(price_of[int(g[0])] for g in r if len(g)) for r in dealt.ranks]
    # list scheduling: the slowest rank exceeds the mean by at most one micro-batch's price
    assert max(totals) <= sum(prices) / world + prices.max() + 1e-9
    for r, groups_r in enumerate(dealt.ranks):  # costliest first: micro-step j pairs every rank's j-th costliest
        held = [price_of[int(g[0])] for g in groups_r if len(g)]
        assert held == sorted(held, reverse=True)
        assert all(len(g) == 0 for g in groups_r[len(held):])  # ghosts last
        assert dealt.rank_costs[r] == pytest.approx(totals[r] + m * 2.0)


def test_equal_counts_bind_a_heavy_micro_batch_shares_its_rank_with_one_light_one() -> None:
    plan = _plan(np.random.default_rng(0), 2, 2, 0)
    groups = planned_groups(plan)
    prices = np.array([100.0 if int(g[0]) == 0 else 10.0 for g in groups])
    dealt = deal_by_price(plan, prices, prices, 0.0)
    heavy = next(r for r in dealt.ranks if any(len(g) and int(g[0]) == 0 for g in r))
    assert sorted(dealt.rank_costs.tolist()) == [20.0, 110.0] and len([g for g in heavy if len(g)]) == 2


def test_prices_must_cover_every_micro_batch() -> None:
    plan = _plan(np.random.default_rng(0), 2, 2, 1)
    with pytest.raises(ValueError, match=r"got 2 prices and 2 costs for 3 micro-batches.*Fix"):
        deal_by_price(plan, np.ones(2), np.ones(2), 0.0)
