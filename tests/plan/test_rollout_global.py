"""One step of rollouts planned over all ranks, rows moving (odb.plan.rollouts.across_ranks), checked against the cost
recomputed here from the lengths: every row once, within the budget, the same micro-step count on every rank and
no empty micro-batch."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb.plan.rollouts.across_ranks import fill_empty, keep_home, plan_rollout_global, split_group
from odb.plan.rollouts.per_rank import plan_rollout_steps


def padded(length: int, multiple: int) -> int:
    return -(-max(length, 1) // multiple) * multiple


def cost(prompt, completion, rows, multiple, layout="padded") -> int:
    """The tokens odb.integrations.trl.rl_forward runs for these flat rows (as tests/plan/test_rollout_plan.py)."""
    if layout == "packed":
        return sum(int(prompt[r]) + int(completion[r]) for r in rows)
    return len(rows) * max(padded(int(prompt[r]) + int(completion[r]), multiple) for r in rows)


def check(plan, prompt, completion, budget, multiple, layout) -> None:
    world, n = prompt.shape
    p, c = prompt.ravel(), completion.ravel()
    assert plan.world == world and plan.n == n
    assert sorted(int(i) for rank in plan.ranks for g in rank for i in g) == list(range(world * n))
    assert {len(rank) for rank in plan.ranks} == {plan.steps}  # the same micro-steps on every rank
    for r, rank in enumerate(plan.ranks):
        for s, g in enumerate(rank):
            assert len(g) >= 1, (r, s)  # TRL's loss runs on rows: never an empty micro-batch
            assert g.tolist() == sorted(g.tolist())
            assert cost(p, c, g, multiple, layout) == plan.costs[r, s] <= budget
            assert plan.widths[r, s].tolist() == [max(max(int(p[i]), 1) for i in g), max(max(int(c[i]), 1)
                                                                                         for i in g)]
    for src in range(world):  # what each rank sends: every row of its slice goes to one rank
        sent = np.concatenate([plan.sent(src, d) for d in range(world)])
        assert sorted(sent.tolist()) == list(range(n))
    assert plan.moved_rows == sum(len(plan.sent(s, d)) for s in range(world) for d in range(world) if s != d)


@settings(max_examples=120, deadline=None)
@given(st.integers(1, 5), st.integers(1, 9), st.sampled_from([1, 4]), st.integers(0, 2 ** 31 - 1),
       st.sampled_from(["padded", "packed"]), st.booleans())
def test_every_row_once_within_budget_same_steps_and_never_empty(world, n, multiple, seed, layout, skewed):
    rng = np.random.default_rng(seed)
    prompt, completion = rng.integers(0, 20, (world, n)), rng.integers(0, 30, (world, n))
    if skewed:  # one rank's rollouts far longer: the plan must move rows, or fill the others' micro-steps
        completion[0] += 40
    budget = int(rng.integers(padded(60, multiple) + padded(30, multiple), 260))
    plan = plan_rollout_global(prompt, completion, budget, multiple, layout=layout)
    check(plan, prompt, completion, budget, multiple, layout)
    again = plan_rollout_global(prompt.copy(), completion.copy(), budget, multiple, layout=layout)
    assert [[g.tolist() for g in r] for r in again.ranks] == [[g.tolist() for g in r] for r in plan.ranks]
    if plan.local:  # the rank-local plan: rows stay, and it is plan_rollout_steps's
        local = plan_rollout_steps(prompt, completion, budget, multiple, layout=layout)
        assert plan.moved_rows == 0 and plan.steps == local.steps


def test_a_rank_of_long_rollouts_hands_rows_to_the_others_and_the_slowest_rank_costs_less():
    rng = np.random.default_rng(4)
    prompt = rng.integers(5, 20, (4, 16))
    completion = np.concatenate([rng.integers(150, 200, (1, 16)), rng.integers(5, 30, (3, 16))])
    budget, overhead = 1024, 64.0
    plan = plan_rollout_global(prompt, completion, budget, micro_batch_cost=overhead)
    local = plan_rollout_steps(prompt, completion, budget, micro_batch_cost=overhead)
    check(plan, prompt, completion, budget, 1, "padded")
    assert not plan.local and plan.moved_rows > 0 and len(plan.sent(0, 1)) + len(plan.sent(0, 2)) > 0
    slowest = (plan.costs.sum(1) + overhead * plan.steps).max()
    assert slowest < (local.costs.sum(1) + overhead * local.steps).max()


def test_fewer_rows_than_micro_steps_fall_back_to_the_rank_local_plan():
    # Rows of 160, 105, 17 and 41 tokens, budget 172: plan_global_step balances them over 3 micro-steps with a
    # ghost, and 2 rows per rank cannot fill 3: the rank-local plan (rows stay) is taken.
    prompt, completion = np.array([[19, 12], [0, 8]]), np.array([[141, 93], [17, 33]])
    plan = plan_rollout_global(prompt, completion, 172)
    check(plan, prompt, completion, 172, 1, "padded")
    local = plan_rollout_steps(prompt, completion, 172)
    assert plan.local and plan.moved_rows == 0
    assert [[g.tolist() for g in r] for r in plan.ranks] == [[(np.sort(local.rows(r, s)) + 2 * r).tolist()
                                                               for s in range(local.steps)] for r in range(2)]


def test_rows_move_only_to_gain():
    # Alike ranks: the rank-local plan costs no more, so nothing moves.
    prompt, completion = np.array([[1, 1, 1], [1, 1, 1]]), np.array([[9, 3, 9], [3, 9, 9]])
    plan = plan_rollout_global(prompt, completion, 100)
    assert plan.local and plan.moved_rows == 0


def test_fill_empty_splits_then_takes_a_row_from_a_rank_with_more():
    tokens = np.array([4, 4, 4, 4, 9, 9])
    groups = [[np.array([0, 1, 2, 3]), np.array([], dtype=np.int64)],
              [np.array([4]), np.array([], dtype=np.int64)], [np.array([5]), np.array([], dtype=np.int64)]]
    assert fill_empty(groups, tokens, "padded")
    assert all(len(g) for rank in groups for g in rank)
    assert sorted(int(i) for rank in groups for g in rank for i in g) == list(range(6))
    short = [[np.array([0]), np.array([], dtype=np.int64)], [np.array([1]), np.array([], dtype=np.int64)]]
    assert not fill_empty(short, np.array([3, 3]), "padded")  # 2 rows, 4 cells: cannot


def test_split_group_never_costs_more_than_the_whole():
    rng = np.random.default_rng(0)
    for _ in range(200):
        tokens = rng.integers(1, 50, 12)
        group = np.sort(rng.choice(12, rng.integers(2, 9), replace=False))
        for layout in ("padded", "packed"):
            a, b = split_group(group, tokens, layout)
            assert len(a) and len(b) and sorted(a.tolist() + b.tolist()) == group.tolist()
            whole = cost(tokens, np.zeros(12, dtype=int), group, 1, layout)
            assert max(cost(tokens, np.zeros(12, dtype=int), x, 1, layout) for x in (a, b)) <= whole


def test_keep_home_moves_no_row_it_need_not():
    groups = [[np.array([4, 5]), np.array([6])], [np.array([0, 1]), np.array([2, 3])]]
    kept = keep_home(groups, n=4)
    assert [[g.tolist() for g in r] for r in kept] == [[[0, 1], [2, 3]], [[4, 5], [6]]]


def test_wrong_lengths_and_rows_over_the_budget_are_refused():
    with pytest.raises(ValueError, match=r"rollout row 1 alone costs 40 padded tokens .* over token_budget=32"):
        plan_rollout_global(np.array([[2, 10], [2, 2]]), np.array([[2, 30], [2, 2]]), 32)
    with pytest.raises(ValueError, match="Rule: both are \\(world, rows\\)"):
        plan_rollout_global(np.array([1, 2]), np.array([1, 2]), 32)
    with pytest.raises(ValueError, match="layout='rows'"):
        plan_rollout_global(np.array([[1]]), np.array([[1]]), 32, layout="rows")
