"""The rl_update section of the benchmark (odb.bench.rl_update): its pieces are right, and its quick run yields
every figure. No timing is asserted."""

import numpy as np
import pytest
import torch

import trl  # noqa: F401  (the section trains TRL's GRPOTrainer; pinned under `make test`: a broken install fails)

from odb.bench.report import goals, render
from odb.bench.rl_update import update_params
from odb.bench.rl_update_plan import (PLAN_ARMS, draw_rollouts, kk_partition, odb_global, odb_rollout, plan_step,
                                      trl_slices, verl_plan)
from odb.bench.rl_update_rollouts import rollout_batch, row_signatures, step_batches
from quick_bench import TEST_TIMEOUT_S

HEAVY = dict(prompt=(40, 0.7, 8, 256), completion=(120, 1.0, 1024))


def lpt_spread(weights, k):
    """Largest-first to the lightest set: the spread KK should not exceed on these inputs."""
    sums = [0.0] * k
    for w in sorted(weights, reverse=True):
        sums[sums.index(min(sums))] += w
    return max(sums) - min(sums)


@pytest.mark.parametrize("k", [2, 3, 8, 32])
@pytest.mark.parametrize("equal_size", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kk_partition_keeps_every_row_once_and_balances(k, equal_size, seed):
    rng = np.random.default_rng(seed)
    weights = np.clip(np.rint(rng.lognormal(5.0, 1.0, 8 * k)), 1, 4096).astype(int).tolist()
    sets = kk_partition(weights, k, equal_size=equal_size)
    assert len(sets) == k
    assert sorted(i for s in sets for i in s) == list(range(len(weights)))
    sums = [sum(weights[i] for i in s) for s in sets]
    assert max(sums) - min(sums) <= max(weights)  # never worse than the heaviest row
    if equal_size:
        assert {len(s) for s in sets} == {8}
    else:
        assert max(sums) - min(sums) <= lpt_spread(weights, k)
    assert kk_partition(weights, k, equal_size=equal_size) == sets  # deterministic


def test_kk_partition_small_cases():
    assert kk_partition([], 3) == [[], [], []]
    assert kk_partition([5], 2) == [[0], []]
    assert sorted(map(len, kk_partition(list(range(7)), 3, equal_size=True))) == [2, 2, 3]
    with pytest.raises(ValueError):
        kk_partition([1, 2], 0)


def test_draw_rollouts_groups_share_a_prompt_and_stay_in_range():
    p, c = draw_rollouts(4, 16, 4, HEAVY["prompt"], (120, 1.0, 256), seed=3)
    assert p.shape == c.shape == (4, 16)
    assert (p.reshape(4, 4, 4) == p.reshape(4, 4, 4)[:, :, :1]).all()
    assert p.min() >= 8 and p.max() <= 256 and c.min() >= 1 and c.max() <= 256
    assert (c == 256).any()  # the heavy tail piles up at max_completion_length
    with pytest.raises(ValueError, match="no multiple of num_generations"):
        draw_rollouts(1, 6, 4, HEAVY["prompt"], HEAVY["completion"])


@pytest.mark.parametrize("world", [1, 8, 32])
def test_every_planning_arm_keeps_the_rows_and_the_budget(world):
    rows = draw_rollouts(world, 32, 8, HEAVY["prompt"], HEAVY["completion"], seed=world)
    budget = 4 * (256 + 1024)
    real = int(rows[0].sum() + rows[1].sum())
    for arm in PLAN_ARMS:
        fig = plan_step(rows, arm, budget, 256.0, slice_rows=4)
        assert fig["real"] == real, arm
        assert fig["max_micro_batch_tokens"] <= budget, arm
        assert 0 < fig["ddp"] <= fig["bound"] + 1e-12 and 0 <= fig["padding_share"] < 1, arm
        assert fig["plan_ms"] >= 0
    assert plan_step(rows, "trl", budget, 256.0, 4)["micro_steps"] == 8
    assert plan_step(rows, "odb_rollout", budget, 256.0, 4)["moved"] == 0.0
    for arm in ("verl", "odb_global_packed", "odb_rollout_packed"):
        assert plan_step(rows, arm, budget, 256.0, 4)["padding_share"] == 0.0
    # odb runs a row without the gap between its prompt and its completion: less padding than TRL's layout
    assert plan_step(rows, "odb_rollout", budget, 256.0, 4)["padding_share"] < plan_step(
        rows, "trl", budget, 256.0, 4)["padding_share"]


def test_trl_slices_pad_every_slice_to_the_rank_widths():
    prompt, completion = np.array([[3, 3, 5, 5]]), np.array([[1, 9, 2, 2]])
    step, moved, _ = trl_slices((prompt, completion), 2)
    assert moved == 0.0 and [m.padded for m in step[0]] == [2 * 14, 2 * 14]
    assert sum(m.real for m in step[0]) == 30


def test_verl_moves_rows_to_balance_and_runs_equal_micro_steps():
    # rank 0 holds all the long rows: balancing must move some of them
    prompt = np.full((2, 8), 10)
    completion = np.array([[500] * 8, [10] * 8])
    step, moved, _ = verl_plan((prompt, completion), budget=1200)
    assert moved > 0 and len(step[0]) == len(step[1])
    loads = [sum(m.padded for m in rank if m) for rank in step]
    assert max(loads) - min(loads) <= 510
    assert all(m.padded <= 1200 for rank in step for m in rank if m)


def test_odb_rollout_rows_stay_and_global_may_move():
    rows = draw_rollouts(4, 16, 4, HEAVY["prompt"], HEAVY["completion"], seed=5)
    step, moved, _ = odb_rollout(rows, 4 * 1280)
    assert moved == 0.0 and len({len(r) for r in step}) == 1
    for packed in (False, True):
        gstep, gmoved, _ = odb_global(rows, 4 * 1280, packed)
        assert 0.0 <= gmoved <= 1.0 and sum(m.real for r in gstep for m in r if m) == int(rows[0].sum() + rows[1].sum())


def test_rollout_batch_is_what_trl_hands_the_loss():
    prompt, completion = np.array([3, 3, 7, 7]), np.array([5, 1, 12, 4])
    b = rollout_batch(prompt, completion, 2, 64, total_loss_tokens=50, seed=0)
    assert b["prompt_ids"].shape == (4, 7) and b["completion_ids"].shape == (4, 12)
    assert b["prompt_mask"].sum(1).tolist() == [3, 3, 7, 7] and b["prompt_mask"][0, -1] == 1  # left padding
    assert b["completion_mask"].sum(1).tolist() == [5, 1, 12, 4] and b["completion_mask"][0, 0] == 1
    assert (b["prompt_ids"][b["prompt_mask"] == 0] == 0).all()
    assert (b["completion_ids"][b["completion_mask"] == 0] == 0).all()
    assert b["completion_ids"][torch.arange(4), torch.as_tensor(completion) - 1].tolist() == [1, 1, 1, 1]  # EOS last
    assert torch.allclose(b["advantages"].reshape(2, 2).sum(1), torch.zeros(2), atol=1e-5)
    assert b["num_items_in_batch"].item() == 50
    assert len(set(row_signatures(b))) == 4


def test_the_step_batches_are_the_same_on_every_call_and_split_across_ranks():
    p = dict(update_params(quick=True), steps=2)
    a, b = step_batches(p, 0, 2), step_batches(p, 0, 2)
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    other = step_batches(p, 1, 2)
    assert row_signatures(a[0]) != row_signatures(other[0])
    total = sum(int(x["completion_mask"].sum()) for x in (a[0], other[0]))
    assert a[0]["num_items_in_batch"].item() == other[0]["num_items_in_batch"].item() == total


@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_the_quick_section_runs_and_yields_every_figure(quick_bench):
    result = quick_bench.results["rl_update"]  # run_rl_update(quick=True) inside the quick run, read back from its file
    u = result["update"]
    assert u["world"] == 2 and "fallback" not in u
    assert u["same_rows"] and u["grad_rel_gap"] < 1e-5  # the same rollouts reached both arms, the same gradient
    trl, odb, packed = u["arms"]["trl"], u["arms"]["odb"], u["arms"]["odb_packed"]
    assert 0 < odb["padding_share"] < trl["padding_share"] < 1 and packed["padding_share"] == 0.0
    for arm in (odb, packed):
        assert arm["max_micro_batch_tokens"] <= u["settings"]["budget"] >= trl["max_micro_batch_tokens"]
    for arm in (trl, odb, packed):
        assert arm["micro_steps_per_step"] >= 1 and arm["update_s"]["median"] > 0 and 0 <= arm["prompt_padding_share"]
    assert u["ratio"] > 0 and u["ratio_spread"] is not None
    assert "odb_real_tokens_mismatch" not in u
    cell = result["planning"]["worlds"]["8"]
    assert set(cell["arms"]) == set(PLAN_ARMS)
    for fig in cell["arms"].values():
        assert {"ddp", "fsdp", "padding_share", "micro_steps", "plan_ms", "moved"} <= set(fig)
    for name, v in result["updates"].items():  # the vLLM-style and bnpo variants: the same rows, the same gradient
        assert v["world"] == 2 and v["same_rows"] and v["grad_rel_gap"] < 1e-5, name
        assert v["arms"]["odb_packed"]["padding_share"] == 0.0 and v["arms"]["odb"]["step_plan"] == "global", name
    assert sum(v["arms"]["odb"]["moved_rows_per_step"] for v in result["updates"].values()) > 0
    losses = result["planning"]["loss_types"]["8"]
    assert losses["bnpo"] == losses["entropy bonus"] == losses["dapo"] and losses["bnpo"]["step_plan"] == "global"
    names = [g.goal for g in goals({"rl_update": result})]
    assert len(names) == 6 + 5 + 3 + 4 and any("odb packed / TRL" in n for n in names)
    assert sum("vLLM-style rollouts, correction on" in n for n in names) == 5
    text = render({"rl_update": result}, markdown=True)
    assert "GRPO policy update" in text and "verl-style" in text and "odb global (padded)" in text
    assert "importance-sampling correction on" in text and "per loss type" in text
    assert "planned only" not in text  # odb's global plan is what the trainer runs
