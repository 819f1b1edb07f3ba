"""Supervised tokens and image patches in the cost: CostModel's side costs, and token_budget="auto"'s
memory model with their features (issues 25 and 26), on synthetic but physical step memories.

Ground truth (bytes, a 1B-class model in bf16, H=2048, 16 layers, a 128k vocabulary, 80 GB):
activations ~1.1 MB per token; a plain cross-entropy holds every token's logits (bf16 logits, the
fp32 upcast and log-softmax: ~1.3 MB per token, in the per-token term), a chunked or fused loss
only the supervised tokens' (~0.5 MB per supervised token, its own term); a vision tower ~0.4 MB
per image patch.
"""

from __future__ import annotations

import numpy as np
import pytest

from odb.config import ODBConfig
from odb.plan.auto.auto_budget import AutoBudget
from odb.plan.costs.cost import CostModel
from odb.plan.windows.packing import plan_packed_window
from odb.plan.windows.planner import _max_counts_sorted, balanced_partition, plan_window
from odb.plan.steps.step_cut import plan_step_share
from odb.plan.auto.step_model import StepModel, shape_features

CAP = 80e9
ACT, LOGITS, CHUNK, PATCH, SAMPLE, CONST = 1.1e6, 1.3e6, 5.2e5, 4.0e5, 5e6, 20e9
PLAIN = np.array([ACT + LOGITS, 0.0, SAMPLE, CONST, 0.0, 0.0])  # tokens, sq, samples, const, supervised, patches
CHUNKED = np.array([ACT, 0.0, SAMPLE, CONST, CHUNK, 0.0])
VISION = np.array([ACT, 0.0, SAMPLE, CONST, CHUNK, PATCH])


def _window(rng, n=256, sup=(0.05, 1.0), images=False):
    """Lengths, supervised tokens (a share of each sample: prompts masked) and image patches of a window."""
    lengths = np.clip(rng.lognormal(6.0, 1.0, n).astype(np.int64), 16, 4096)
    supervised = np.maximum(1, (rng.uniform(*sup, n) * lengths).astype(np.int64))
    patches = np.zeros(n, dtype=np.int64)
    if images:  # half the samples carry an image: its patches, a quarter of them as tokens in input_ids
        has = rng.random(n) < 0.5
        patches[has] = rng.integers(256, 4097, int(has.sum()))
        lengths = lengths + patches // 4
    return lengths, supervised, patches


def _simulate(coef, *, seed=0, steps=150, phases=((0.05, 1.0),), images=False, blind=False, max_patches=None):
    """Windows planned under each proposal (side counts given to the planner), every batch's true memory fed
    back. ``blind``: the memory model and the planner ignore supervised tokens and patches (the model before
    issue 26). Returns (true peaks, tokens per step) and the AutoBudget."""
    rng = np.random.default_rng(seed)
    ab = AutoBudget(CAP, 2048)
    plan = ab.propose()
    peaks, tokens = [], []
    for phase in phases:
        done = len(peaks) + steps
        while len(peaks) < done:
            lengths, supervised, patches = _window(rng, sup=phase, images=images)
            side = np.stack([patches, supervised], axis=1)
            cost = plan.cost_model(max_patches=max_patches)
            for g in plan_window(lengths, np.arange(len(lengths)), cost, final=True,
                                 patches=None if blind else side).groups:
                f = shape_features(lengths[g], supervised=supervised[g], patches=patches[g])
                peaks.append(float(f @ coef))
                tokens.append(int(lengths[g].sum()))
                if max_patches is not None:
                    assert patches[g].sum() <= max_patches  # the patch cap stays a hard limit
                ab.observe(f * np.array([1, 1, 1, 1, 0, 0]) if blind else f, peak=peaks[-1])
            plan = ab.propose()
    return np.array(peaks), np.array(tokens), ab


@pytest.mark.parametrize("coef", [PLAIN, CHUNKED], ids=["plain-ce", "chunked"])
def test_auto_stays_under_the_cap_with_a_plain_or_a_chunked_loss(coef):
    peaks, tokens, ab = _simulate(coef)
    assert peaks.max() <= CAP
    plan = ab.last_plan
    fitted = ab.memory.coefficients()
    if coef is CHUNKED:  # a supervised token costs its logits: CHUNK / ACT tokens-equivalent, read off the fit
        assert fitted["supervised_tokens"] == pytest.approx(CHUNK, rel=1e-6)
        assert plan.loss_token_cost == pytest.approx(CHUNK / ACT, rel=0.02)
    else:  # logits for every token: all in the per-token term, nothing per supervised token
        assert fitted["supervised_tokens"] == pytest.approx(0.0, abs=1e-3 * CHUNK)
        assert plan.loss_token_cost == 0.0
    assert peaks[50:].max() >= 0.8 * CAP  # and it uses the memory


def test_a_chunked_loss_fits_more_tokens_per_step_than_a_plain_one():
    _, plain, _ = _simulate(PLAIN)
    _, chunked, _ = _simulate(CHUNKED)
    assert chunked[50:].mean() >= 1.5 * plain[50:].mean()


def test_a_model_blind_to_supervised_tokens_exceeds_the_cap_when_supervision_grows():
    # completion-only data first (5-20% of each sample supervised), then fully supervised samples: a model
    # that does not see supervised tokens learns a small per-token cost and then overshoots; one that does
    # prices each supervised token and stays under.
    phases = ((0.05, 0.2), (1.0, 1.0))
    blind, _, _ = _simulate(CHUNKED, phases=phases, blind=True)
    seeing, _, _ = _simulate(CHUNKED, phases=phases)
    assert blind.max() > CAP
    assert seeing.max() <= CAP


def test_image_patches_are_priced_from_the_fit_and_the_patch_cap_stays_hard():
    peaks, _, ab = _simulate(VISION, images=True, max_patches=16384)
    assert peaks.max() <= CAP
    assert ab.memory.coefficients()["image_patches"] == pytest.approx(PATCH, rel=1e-6)
    assert ab.last_plan.image_patch_cost == pytest.approx(PATCH / ACT, rel=0.02)


def test_a_text_only_run_leaves_the_patch_feature_out_of_the_fit():
    _, _, ab = _simulate(CHUNKED, steps=40)
    assert ab.memory.coefficients()["image_patches"] == 0.0 and ab.last_plan.image_patch_cost == 0.0


# --- CostModel's side costs in every planner ------------------------------------------------------


def _side_pool(seed, n=300):
    rng = np.random.default_rng(seed)
    lengths, supervised, patches = _window(rng, n=n, images=True)
    return lengths, np.stack([patches, supervised], axis=1)


@pytest.mark.parametrize("dims", [1, 2])
def test_fast_run_counts_match_the_reference_scan_with_side_costs(dims):
    lengths, side = _side_pool(1, 200)
    padded = np.sort(lengths)[::-1][:, None] if dims == 1 else np.stack([lengths, lengths // 3], axis=1)
    cost = CostModel((20000,), image_patch_cost=0.3, loss_token_cost=2.0, max_patches=9000)
    assert _max_counts_sorted(cost, padded, side).tolist() == cost.max_counts_sorted(padded, side).tolist()


def _within(cost, lengths, side, groups):
    for g in groups:
        assert cost.batch_cost(cost.pad(lengths[g][:, None]), side[g]) <= cost.total_budget * (1 + 1e-9)
        assert side[g, 0].sum() <= cost.max_patches


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_every_planner_keeps_the_side_costs_within_the_budget(layout):
    lengths, side = _side_pool(2)
    cost = CostModel((30000,), image_patch_cost=0.5, loss_token_cost=1.5, max_patches=12000, layout=layout)
    ids = np.arange(len(lengths))
    plan = plan_window(lengths, ids, cost, final=False, patches=side)
    _within(cost, lengths, side, plan.groups)
    _within(cost, lengths, side, plan_window(lengths, ids, cost, final=True, patches=side).groups)
    _within(cost, lengths, side, plan_step_share(lengths, ids, cost, 500.0, side).groups)
    _within(cost, lengths, side, balanced_partition(lengths, ids, cost, 40, side))
    if layout == "packed":
        _within(cost, lengths, side, plan_packed_window(lengths, ids, cost, final=True, patches=side).groups)
    # without side costs the same pool packs more per batch: the costs were used
    plain = plan_window(lengths, ids, CostModel((30000,), max_patches=12000, layout=layout), final=True, patches=side)
    assert len(plain.groups) < len(plan_window(lengths, ids, cost, final=True, patches=side).groups)


def test_rank_pairing_cost_counts_vision_cost():
    cost = CostModel((10000,), image_patch_cost=0.5)
    text = cost.group_cost(np.array([[100], [100]]), np.array([[0, 50], [0, 50]]))
    image = cost.group_cost(np.array([[100], [100]]), np.array([[1024, 50], [0, 50]]))
    assert (text, image) == (200, 712)


def test_config_options_validate_and_reach_the_cost_model():
    cfg = ODBConfig(token_budget=4096, image_patches_key="n_patches", max_image_patches=8192, image_patch_cost=0.25,
                    loss_token_cost=1.5)
    cost = CostModel.from_config(cfg)
    assert (cost.image_patch_cost, cost.loss_token_cost, cost.side_costs) == (0.25, 1.5, True)
    with pytest.raises(ValueError, match="image_patches_key"):
        ODBConfig(token_budget=4096, image_patch_cost=0.25)
    with pytest.raises(ValueError, match="loss_token_cost=-1"):
        ODBConfig(token_budget=4096, loss_token_cost=-1.0)


def test_a_step_model_state_saved_with_four_features_loads():
    m = StepModel("memory")
    state = m.state_dict()
    state.update(features=[[10.0, 100.0, 1.0, 1.0]], values=[5.0], covariance=[[0.0] * 4] * 4,
                 coef=[1.0, 0.0, 0.0, 0.0])
    m.load_state_dict(state)
    assert m.points().tolist() == [[10.0, 100.0, 1.0, 1.0, 0.0, 0.0]]
    assert m.predict(shape_features([10], supervised=[4])) == 10.0
