"""The scale section (odb.bench.scale): the step-efficiency figures on hand-made steps, the arms' steps (G
samples each, every sample once per epoch), and the quick run (every arm and cell, efficiencies in (0, 1])."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from odb.bench import scale
from odb.bench.report import goals, plot_scale, render, scale_table
from odb.bench.scale import MicroBatch as MB
from odb.bench.scale import step_efficiency

OH = scale.OVERHEAD


def test_a_balanced_step_without_padding_is_fully_efficient() -> None:
    step = [[MB(700, 700, 700)], [MB(700, 700, 400)], [MB(700, 700, 100)]]
    e = step_efficiency(step)
    assert e == {"ddp": 1.0, "fsdp": 1.0, "bound": 1.0, "cap_bound": 1.0}


def test_an_imbalanced_step_gives_the_hand_computed_value() -> None:
    # rank 0: two micro-batches, 2 x 300 padded (real 500) and 1 x 100; rank 1: one of 4 x 200 (real 600)
    step = [[MB(600, 500, 300), MB(100, 100, 100)], [MB(800, 600, 200)]]
    e = step_efficiency(step, overhead=OH)
    fair = (500 + 100 + 600) / 2 + OH  # 856
    assert e["ddp"] == pytest.approx(fair / max(600 + 100 + 2 * OH, 800 + OH))  # / 1212
    # FSDP: micro-step 0 waits for 800 + OH, micro-step 1 for 100 + OH (rank 1 runs a ghost there)
    assert e["fsdp"] == pytest.approx(fair / ((800 + OH) + (100 + OH)))
    assert e["bound"] == 1.0
    assert e["ddp"] == pytest.approx(856 / 1212)


def test_ghosts_count_as_overhead_only() -> None:
    ghost = [[MB(1000, 1000, 1000), None], [MB(500, 500, 500), MB(500, 500, 500)]]
    e = step_efficiency(ghost, overhead=OH)
    fair = 2000 / 2 + OH
    assert e["ddp"] == pytest.approx(fair / (1000 + 2 * OH))  # rank 0: its batch + a ghost's overhead
    assert e["fsdp"] == pytest.approx(fair / ((1000 + OH) + (500 + OH)))
    # no ghost, same costs, one micro-batch fewer on rank 0: the ghost's overhead is what it costs
    assert step_efficiency([[MB(1000, 1000, 1000)], ghost[1]], overhead=OH)["ddp"] == e["ddp"]


def test_the_bound_is_set_by_the_longest_sample() -> None:
    step = [[MB(1024, 1024, 1024)], [MB(64, 64, 64)]]
    e = step_efficiency(step, overhead=OH)
    assert e["bound"] == pytest.approx((1088 / 2 + OH) / (1024 + OH))
    assert e["ddp"] == pytest.approx(e["bound"])  # nothing better exists: the long sample is alone


def test_the_cap_bound_counts_the_micro_batches_the_cap_forces() -> None:
    # 2 ranks, 3 x 4096 real tokens each: at least 3 micro-batches a rank under a cap of 4096
    full = MB(4096, 4096, 1024)
    step = [[full, full, full], [full, full, full]]
    e = step_efficiency(step, overhead=OH, cap=4096)
    assert e["bound"] == 1.0
    assert e["cap_bound"] == pytest.approx((3 * 4096 + OH) / (3 * 4096 + 3 * OH)) == pytest.approx(e["ddp"])
    assert step_efficiency([[MB(100, 100, 100)], [MB(100, 100, 100)]], overhead=OH)["cap_bound"] == 1.0


def test_micro_batch_costs_padded_and_packed() -> None:
    x = np.array([10, 30, 20])
    assert scale.micro_batch(x, [0, 1, 2]) == MB(90, 60, 30)
    assert scale.micro_batch(x, [0, 1, 2], packed=True) == MB(60, 60, 30)
    assert scale.micro_batch(x, []) is None


LENGTHS = scale.draw(scale.real_lengths("sharegpt"), 3 * 16 * 4, seed=0)  # 3 steps of G = 16 x 4


@pytest.mark.parametrize("world,share", [(4, 16), (8, 4), (16, 1)])
def test_sampler_arms_hold_g_samples_a_step_and_every_sample_once(world: int, share: int) -> None:
    g = world * share
    lengths = LENGTHS[:3 * g]
    b, acc = scale.per_rank_batch(share)
    for plan in (scale.fixed_plan(len(lengths), world, share), scale.group_by_length_plan(lengths, world, share),
                 scale.batch_rebalance_plan(lengths, world, share)):
        assert len(plan) == 3
        for step in plan:
            assert len(step) == world and all(len(rank) == acc for rank in step)
            assert sum(len(mb) for rank in step for mb in rank) == g
        flat = [i for step in plan for rank in step for mb in rank for i in mb]
        assert sorted(flat) == list(range(len(lengths)))
    # the fixed-size arms: micro-batches of B, whose worst case fits the cap
    for plan in (scale.fixed_plan(len(lengths), world, share), scale.group_by_length_plan(lengths, world, share)):
        assert {len(mb) for step in plan for rank in step for mb in rank} == {b}
        assert b * scale.MAX_LENGTH <= scale.TOKEN_BUDGET


def test_batch_rebalance_on_the_same_steps_holds_fixeds_samples() -> None:
    world, share = 8, 4
    lengths = LENGTHS[:3 * world * share]
    same = scale.batch_rebalance_same_steps_plan(lengths, world, share)
    fixed = scale.fixed_plan(len(lengths), world, share)
    assert [sorted(i for rank in s for mb in rank for i in mb) for s in same] == \
        [sorted(i for rank in s for mb in rank for i in mb) for s in fixed]
    assert len(scale.batch_rebalance_same_steps_plan(lengths, world, share, max_steps=2)) == 2


def test_batch_rebalance_planned_once_is_what_every_rank_iterates() -> None:
    for world, share in ((4, 16), (8, 4)):
        lengths = LENGTHS[:3 * world * share]
        assert scale.batch_rebalance_plan(lengths, world, share) == \
            scale.batch_rebalance_plan(lengths, world, share, every_rank=True)


def test_group_by_length_deals_batches_as_accelerate_does() -> None:
    accelerate = pytest.importorskip("accelerate.data_loader")
    from torch.utils.data import BatchSampler

    world, share = 4, 16
    lengths = LENGTHS[:3 * world * share]
    b, acc = scale.per_rank_batch(share)
    plan = scale.group_by_length_plan(lengths, world, share)
    order = scale.group_by_length_order(lengths, share)
    for r in range(world):
        shard = accelerate.BatchSamplerShard(BatchSampler(order, b, drop_last=False), num_processes=world,
                                             process_index=r, split_batches=False, even_batches=True)
        assert [list(x) for x in shard] == [mb for step in plan for mb in step[r]]


def test_odb_steps_hold_the_fixed_arms_samples() -> None:
    """Every odb step holds the next s samples of each rank's DistributedSampler order (fixed's step): the bound
    of fixed's steps is odb's."""
    world, share = 4, 4
    lengths = LENGTHS[:3 * world * share]
    fixed = scale.fixed_plan(len(lengths), world, share)
    steps, held = scale.odb_loader_steps(lengths, world, share, "padded", "rank")
    assert len(steps) == len(fixed) == 3
    for step, h, f in zip(steps, held, fixed):
        assert h["sample_ids"] == sorted(i for rank in f for mb in rank for i in mb)
        assert len(h["micro_steps"]) == 1 and all(len(rank) == h["micro_steps"][0] for rank in step)
        assert all(m is None or m.padded <= scale.TOKEN_BUDGET for rank in step for m in rank)


@pytest.fixture(scope="module")
def quick() -> dict:
    torch.manual_seed(0)
    return scale.run_scale(quick=True, plan_repeats=2)


def test_the_quick_run_returns_every_arm_and_cell(quick: dict) -> None:
    assert set(quick["workloads"]) == set(scale.WORKLOADS)
    for w in quick["workloads"].values():
        assert set(w["cells"]) == {f"{world}x{s}" for world in scale.QUICK_WORLDS for s in scale.QUICK_SHARES}
        for cell in w["cells"].values():
            assert set(cell["arms"]) == set(scale.ARMS)
            assert 0.0 < cell["bound"]["median"] <= 1.0
            for arm, m in cell["arms"].items():
                if arm in scale.GLOBAL_ARMS and not quick["global_available"]:
                    assert m == {"available": False, "error": scale.NOT_AVAILABLE}
                    continue
                assert "error" not in m, (arm, m.get("error"))
                assert m["steps"] == scale.QUICK_STEPS and m["global_batch_size"] == cell["world"] * cell["share"]
                for key in ("ddp", "fsdp", "bound"):
                    assert 0.0 < m[key]["p10"] <= m[key]["median"] <= m[key]["p90"] <= 1.0, (arm, key, m[key])
                # no arm beats the bound of its own steps, nor does FSDP beat DDP
                assert m["ddp"]["median"] <= m["bound"]["median"] + 1e-9
                if arm != "batch_rebalance":
                    assert m["ddp"]["median"] <= m["cap_bound"]["median"] + 1e-9 <= m["bound"]["median"] + 2e-9
                assert m["fsdp"]["median"] <= m["ddp"]["median"] + 1e-9
                if arm != "batch_rebalance":  # the one arm that knows no memory cap
                    assert m["max_micro_batch_tokens"] <= scale.TOKEN_BUDGET
            if quick["global_available"]:  # through the loader at these sizes, and the same as the direct plan
                for arm in scale.GLOBAL_ARMS:
                    assert cell["arms"][arm]["source"] == "ODBDataLoader (= plan_global_step)"
                pair = cell["paired"]["odb_global_minus_batch_rebalance"]
                assert pair["steps"] == scale.QUICK_STEPS and 0 <= pair["steps_below"] <= pair["steps"]
                assert pair["min"] <= pair["median"] <= pair["max"]
                assert 0.0 < cell["paired"]["batch_rebalance_same_steps"]["ddp"]["median"] <= 1.0


def test_the_quick_run_renders_its_table_goals_and_plot(quick: dict, tmp_path) -> None:
    results = {"scale": quick}
    text = scale_table(quick, markdown=True)
    assert "| world | s/rank | G | steps | fixed | group_by_length |" in text and "bound / with the cap |" in text
    for label in scale.ARM_LABELS.values():
        assert f"| {label} |" in text
    assert "## Scale: step efficiency against world size" in render(results, markdown=True)
    rows = goals(results)
    assert len(rows) == len(quick["goals"]) and any("plan_global_step" in r[0] for r in rows)
    assert all(r[3] in (True, False, None) for r in rows)
    plot_scale(quick, str(tmp_path / "scale.png"))
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arms_left_out_are_reported_with_the_reason() -> None:
    result = scale.run_scale(worlds=(2,), shares=(1,), steps={2: 2}, workloads=("sharegpt",), plan_repeats=1,
                             skip={("sharegpt", 2, None): {"odb_rank_packed": "too slow here"}})
    arm = result["workloads"]["sharegpt"]["cells"]["2x1"]["arms"]["odb_rank_packed"]
    assert arm == {"available": True, "skipped": "too slow here"}
    text = scale_table(result)
    assert "not run" in text and "odb per-rank packed (too slow here)" in text
    assert any("Left out" in n and "odb per-rank packed" in n for n in result["notes"])
