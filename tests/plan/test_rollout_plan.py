"""The micro-steps of one training step of rollouts on every rank (odb.plan.rollouts.per_rank), checked against the
cost recomputed here from the lengths: every row once, within the budget, the same row counts on every rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb.plan.rollouts.per_rank import plan_rollout_steps


def padded(length: int, multiple: int) -> int:
    return -(-max(length, 1) // multiple) * multiple


def cost(prompt, completion, rows, multiple, layout="padded") -> int:
    """The tokens odb.integrations.trl.rl_forward runs for these rows: each row's prompt and completion without
    the gap between them, right-padded to the longest (rounded up), or packed in one row."""
    if layout == "packed":
        return sum(int(prompt[r]) + int(completion[r]) for r in rows)
    return len(rows) * max(padded(int(prompt[r]) + int(completion[r]), multiple) for r in rows)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 4), st.integers(1, 9), st.sampled_from([1, 4]), st.integers(0, 2 ** 31 - 1),
       st.sampled_from(["padded", "packed"]))
def test_every_row_once_within_budget_and_the_same_row_counts_on_every_rank(world, n, multiple, seed, layout):
    rng = np.random.default_rng(seed)
    prompt, completion = rng.integers(0, 20, (world, n)), rng.integers(0, 30, (world, n))
    budget = int(rng.integers(padded(50, multiple) + padded(30, multiple), 200))
    plan = plan_rollout_steps(prompt, completion, budget, multiple, layout=layout)
    assert sum(plan.sizes) == n and all(s >= 1 for s in plan.sizes)
    for r in range(world):
        rows = [plan.rows(r, s).tolist() for s in range(plan.steps)]
        assert sorted(sum(rows, [])) == list(range(n))
        for s, part in enumerate(rows):
            assert cost(prompt[r], completion[r], part, multiple, layout) == plan.costs[r, s] <= budget
            widths = plan.widths[r, s].tolist()  # the micro-batch's tensors are trimmed to its longest of each
            assert widths == [max(max(int(prompt[r, i]), 1) for i in part), max(max(int(completion[r, i]), 1)
                                                                                for i in part)]
    # The cut is of least total cost: no other cut of the sorted rows (same rows per micro-step on every rank)
    # costs less (brute force over every composition of n).
    overhead = budget / 16

    def total(sizes):
        out, start = 0.0, 0
        for size in sizes:
            part = [cost(prompt[r], completion[r], plan.order[r, start:start + size], multiple, layout)
                    for r in range(world)]
            if max(part) > budget:
                return float("inf")
            out, start = out + max(part) + overhead, start + size
        return out

    def compositions(m):
        if m == 0:
            yield ()
            return
        for first in range(1, m + 1):
            for rest in compositions(m - first):
                yield (first,) + rest

    assert total(plan.sizes) <= min(total(c) for c in compositions(n)) + 1e-9


def test_a_row_alone_over_the_budget_is_named():
    with pytest.raises(ValueError, match=r"odb rank 1: rollout row 0 alone costs 30 padded tokens .* token_budget=20"):
        plan_rollout_steps(np.array([[2, 2], [10, 1]]), np.array([[3, 3], [20, 1]]), token_budget=20)


def test_the_plan_is_the_same_whatever_ties():
    a = plan_rollout_steps(np.array([[3, 3, 3, 3]]), np.array([[2, 2, 2, 2]]), token_budget=10)
    assert [a.rows(0, s).tolist() for s in range(a.steps)] == [[0, 1], [2, 3]]


def test_a_long_row_does_not_pad_the_short_ones():
    # one completion of 60 among completions of 4: greedy would pad three short rows to 60 in one micro-batch
    plan = plan_rollout_steps(np.array([[2, 2, 2, 2]]), np.array([[60, 4, 4, 4]]), token_budget=256)
    assert plan.sizes == (1, 3) and plan.costs.tolist() == [[62, 18]]


def test_padded_rows_pay_their_longest_prompt_and_completion_together():
    # a long prompt with a short completion and the reverse: TRL's layout pads both to 2 x (20 + 20) = 80
    plan = plan_rollout_steps(np.array([[20, 2]]), np.array([[2, 20]]), token_budget=48)
    assert plan.sizes == (2,) and plan.costs.tolist() == [[44]] and plan.widths.tolist() == [[[20, 20]]]


def test_packed_rows_cost_their_tokens_and_fill_the_budget():
    plan = plan_rollout_steps(np.array([[2, 2, 2, 2]]), np.array([[60, 4, 4, 4]]), token_budget=80, layout="packed")
    assert plan.sizes == (4,) and plan.costs.tolist() == [[80]]
    with pytest.raises(ValueError, match="layout='padded' or layout='packed'"):
        plan_rollout_steps(np.array([[2]]), np.array([[3]]), token_budget=80, layout="rows")
