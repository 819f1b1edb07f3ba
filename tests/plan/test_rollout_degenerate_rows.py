"""Rollout plans (GRPO/RLOO rows) over degenerate rows: completions of 0 tokens (a rollout cut at once), prompts of
0 tokens, every row of a rank or of the step empty. Every row is planned once, every micro-batch within the budget
and not empty, and nothing divides by zero (the loader's bad-input matrix is tests/loader/test_bad_input.py)."""

from __future__ import annotations

import numpy as np
import pytest

from odb.plan.rollouts.across_ranks import plan_rollout_global
from odb.plan.rollouts.per_rank import plan_rollout_steps

BUDGET = 64


def cases(world: int, rows: int):
    rng = np.random.default_rng(world * 10 + rows)
    prompt = rng.integers(1, 12, size=(world, rows))
    completion = rng.integers(1, 20, size=(world, rows))
    yield "one empty completion", prompt, np.where(np.arange(rows) == 0, 0, completion)
    yield "a rank's completions empty", prompt, np.where(np.arange(world)[:, None] == 0, 0, completion)
    yield "every completion empty", prompt, np.zeros_like(completion)
    yield "every row empty", np.zeros_like(prompt), np.zeros_like(completion)


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("world,rows", [(1, 4), (2, 6), (3, 5), (4, 8)])
def test_degenerate_rows_plan(layout: str, world: int, rows: int) -> None:
    with np.errstate(all="raise"):  # a division by zero or an overflow raises here
        for name, prompt, completion in cases(world, rows):
            local = plan_rollout_steps(prompt, completion, BUDGET, layout=layout)
            assert sum(local.sizes) == rows, name
            assert (local.costs <= BUDGET).all(), name
            moved = plan_rollout_global(prompt, completion, BUDGET, layout=layout)
            planned = sorted(int(r) for groups in moved.ranks for g in groups for r in np.asarray(g).ravel())
            assert planned == list(range(world * rows)), name
            assert all(len(g) for groups in moved.ranks for g in groups), f"{name}: an empty micro-batch"
            assert (moved.costs <= BUDGET).all(), name
