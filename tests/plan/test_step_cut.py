"""The least-cost cut of one optimizer step's samples (odb.plan.steps.step_cut): against brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb.plan.costs.cost import CostModel
from odb.plan.steps.step_cut import plan_step_share


def total_cost(groups, lengths, cost: CostModel, overhead: float) -> float:
    return sum(cost.batch_cost(cost.pad(lengths[g].reshape(len(g), -1))) + overhead for g in groups)


def brute_force(lengths: np.ndarray, cost: CostModel, overhead: float) -> float:
    """The cheapest cut of the samples sorted by decreasing length into consecutive feasible runs."""
    order = np.argsort(-lengths, kind="stable")
    n, best = len(order), np.inf
    for k in range(n):
        for cuts in itertools.combinations(range(1, n), k):
            bounds = (0,) + cuts + (n,)
            groups = [order[a:b] for a, b in zip(bounds, bounds[1:])]
            if all(cost.batch_cost(cost.pad(lengths[g][:, None])) <= cost.total_budget for g in groups):
                best = min(best, total_cost(groups, lengths, cost, overhead))
    return best


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 60), min_size=1, max_size=8), st.sampled_from([0.0, 7.0, 40.0, 500.0]),
       st.sampled_from([1, 8]))
def test_the_cut_is_the_cheapest_and_emits_every_sample_once(lengths, overhead, multiple):
    lengths = np.array(lengths)
    cost = CostModel((120,), pad_to_multiple_of=multiple)
    plan = plan_step_share(lengths, np.arange(len(lengths)), cost, overhead)
    assert sorted(np.concatenate(plan.groups).tolist()) == list(range(len(lengths)))
    assert all(cost.batch_cost(cost.pad(lengths[g][:, None])) <= 120 for g in plan.groups)
    assert total_cost(plan.groups, lengths, cost, overhead) == pytest.approx(brute_force(lengths, cost, overhead))


def test_zero_overhead_pads_nothing_and_a_large_one_fills_the_budget():
    lengths = np.array([40, 39, 21, 20, 5, 5, 4])
    cost = CostModel((120,))
    fine = plan_step_share(lengths, np.arange(7), cost, 0.0).groups
    assert all(len(set(lengths[g])) == 1 for g in fine)  # only equal lengths share a batch
    coarse = plan_step_share(lengths, np.arange(7), cost, 10_000.0).groups
    assert len(coarse) == 2  # 40+39+21 (3 x 40) and the rest (4 x 20): the fewest batches the budget allows


def test_oversize_samples_are_reported_not_planned():
    plan = plan_step_share(np.array([200, 10]), np.arange(2), CostModel((100,)), 10.0)
    assert plan.oversize.tolist() == [0] and [g.tolist() for g in plan.groups] == [[1]]
