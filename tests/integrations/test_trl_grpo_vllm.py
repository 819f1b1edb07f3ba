"""TRL's GRPOTrainer as people run it with vLLM, with odb cutting the policy update: the sampling log-probabilities
and vLLM's importance-sampling correction are carried through odb's cut, move and packed layout, and every
optimizer step's gradient and every logged metric is TRL's.

No vLLM runs here: generation only differs between vLLM's server and colocate modes and TRL's own, and TRL's
hook for a custom backend (``rollout_func``) hands TRL completions with per-token sampling log-probabilities
as vLLM returns them (tests/support/trl_rl_workers.py: the policy's own processed distribution, offset per
token as a sampler that differs from the trainer, one token in seven unscorable). TRL then computes the old
log-probabilities and the corrected importance ratio of each ``vllm_importance_sampling_mode`` itself, and its
loss applies it. Each case checks that the correction bit (ratios clipped or masked at the bounds).
"""

from __future__ import annotations

import numpy as np
import pytest

import trl  # noqa: F401  (pinned under `make test`: a broken install fails, never skips)
import trl_rl_workers as R
from dist_harness import run_ranks
from test_trl_grpo import BUDGET, check_moved, check_pair, mixed_micro_batches

from odb.integrations import trl as odb_trl
from odb.integrations.trl.rl_rows import COMPLETION, ROW

pytestmark = pytest.mark.trl

# The offsets (+-0.3 per token) cross TIGHT's bounds; the end-of-sequence bias at generation (sampled with it,
# scored by TRL without it) gives a completion's last token a ratio near 0.1. A sequence's ratio is the product
# of its tokens': near 0.1 with that last token, spread around 1 for a completion cut at max_completion_length.
TIGHT = dict(clip_min=0.8, clip_max=1.25)
WIDE = dict(clip_min=0.1, clip_max=2.0)
# Every vllm_importance_sampling_mode with its bounds, importance_sampling_level token and sequence, off-policy
# masking (which reads the sampling log-probabilities), padded and packed.
VLLM = {
    "token_truncate": dict(loss_type="grpo", num_iterations=2, vllm=dict(mode="token_truncate", **TIGHT)),
    "token_mask_bnpo_entropy": dict(loss_type="bnpo", args={"entropy_coef": 0.3},
                                    vllm=dict(mode="token_mask", **TIGHT)),
    "sequence_truncate_packed": dict(loss_type="grpo", args={"importance_sampling_level": "sequence"},
                                     vllm=dict(mode="sequence_truncate", **WIDE), layout="packed"),
    "sequence_mask_kl": dict(loss_type="dapo", beta=0.1, vllm=dict(mode="sequence_mask", **WIDE)),
    "off_policy_mask_no_low_bound": dict(loss_type="dapo", args={"off_policy_mask_threshold": 0.05},
                                         vllm=dict(mode="token_truncate", clip_min=None, clip_max=1.25)),
    "vespo_token_mask_packed": dict(loss_type="vespo", vllm=dict(mode="token_mask", **TIGHT), layout="packed"),
}


def correction_bit(logs, vllm) -> bool:
    """TRL's logged ratios reached a bound: clipped (truncate) or masked to 0 (mask) somewhere."""
    low = [log["sampling/importance_sampling_ratio/min"] for log in logs if "sampling/importance_sampling_ratio/min"
           in log]
    high = [log["sampling/importance_sampling_ratio/max"] for log in logs if "sampling/importance_sampling_ratio/max"
            in log]
    assert low and high, "TRL applied no importance-sampling correction"
    if vllm["mode"].endswith("mask"):
        return min(low) == 0.0
    bounds = [b for b in (vllm["clip_min"], vllm["clip_max"]) if b is not None]
    return any(abs(x - b) < 1e-6 for x in low + high for b in bounds)


@pytest.mark.parametrize("case", sorted(VLLM))
def test_vllm_rollouts_train_as_trl_does(tmp_path, case):
    p = dict(VLLM[case], budget=BUDGET, out=str(tmp_path))
    got = R.pair_ranks(0, 1, p)
    check_pair(got["ref"], got["odb"], case + (" packed" if p.get("layout") == "packed" else ""))
    assert correction_bit(got["ref"]["logs"], p["vllm"]), case


def test_the_ratio_is_cut_per_token_or_per_row_as_the_mode_says(tmp_path):
    # odb's list of TRL's keys, resolved at enable_odb from the trainer's settings (not from shapes)
    for mode, kind in (("token_mask", COMPLETION), ("sequence_truncate", ROW)):
        trainer = R.build(dict(loss_type="grpo", vllm=dict(mode=mode, **TIGHT)), str(tmp_path / mode),
                          R.GradRecorder())
        keys = odb_trl.enable_odb(trainer, token_budget=BUDGET).odb_rl.keys
        assert keys.kind("importance_sampling_ratio") == kind and keys.kind("sampling_per_token_logps") == COMPLETION
        # TRL's ratio of a padded token: exp(0) = 1 inside the bounds (a mask mode), clipped (a truncate mode)
        assert keys.pad("importance_sampling_ratio") == (1.0 if kind == COMPLETION else 0.0)


def test_vespo_bounds_that_move_a_padded_ratio_off_1_are_refused(tmp_path):
    trainer = R.build(dict(loss_type="vespo", vllm=dict(mode="token_truncate", clip_min=1.1, clip_max=3.0)),
                      str(tmp_path), R.GradRecorder())
    with pytest.raises(ValueError, match="loss_type='vespo' with vllm_importance_sampling_clip_min=1.1.*depends on "
                                         "how wide the slice is padded.*Fix: bounds that keep 1"):
        odb_trl.enable_odb(trainer, token_budget=BUDGET)


def test_a_value_of_another_shape_than_its_key_stops_the_step(tmp_path):
    trainer = odb_trl.enable_odb(R.build(dict(loss_type="grpo", vllm=dict(mode="sequence_mask", **WIDE)),
                                         str(tmp_path), R.GradRecorder()), token_budget=BUDGET)
    import torch

    inputs = {"prompt_ids": torch.ones(2, 3, dtype=torch.long), "prompt_mask": torch.ones(2, 3, dtype=torch.long),
              "completion_ids": torch.ones(2, 4, dtype=torch.long),
              "completion_mask": torch.ones(2, 4, dtype=torch.long), "advantages": torch.zeros(2),
              "importance_sampling_ratio": torch.ones(2, 4), "num_items_in_batch": torch.tensor(8)}
    with pytest.raises(ValueError, match=r"'importance_sampling_ratio' has shape \(2, 4\). Rule: odb lists "
                                         r"'importance_sampling_ratio' as a row value here"):
        trainer.odb_rl.keys.check(inputs, "GRPOTrainer")


VLLM_GLOBAL = {
    "dr_grpo_token_mask": dict(loss_type="dr_grpo", vllm=dict(mode="token_mask", **TIGHT)),
    "cispo_sequence_truncate_no_high_bound": dict(loss_type="cispo", vllm=dict(mode="sequence_truncate",
                                                                               clip_min=0.1, clip_max=None)),
    "sapo_sequence_mask_packed": dict(loss_type="sapo", vllm=dict(mode="sequence_mask", **WIDE), layout="packed"),
    "luspo_token_truncate": dict(loss_type="luspo", args={"importance_sampling_level": "sequence"},
                                 vllm=dict(mode="token_truncate", **TIGHT)),
    "vespo_token_mask_packed": VLLM["vespo_token_mask_packed"],
    "bnpo_token_mask_entropy": VLLM["token_mask_bnpo_entropy"],
}


@pytest.mark.dist
def test_two_ranks_move_vllm_rollouts_and_get_trls_gradient_and_metrics(tmp_path):
    # Every vllm_importance_sampling_mode again, with the loss types the other two-process runs leave out
    # (tests/integrations/test_trl_grpo.py): rows move between the ranks (step_plan="auto" takes "global").
    runs = [dict(case, budget=BUDGET) for case in VLLM_GLOBAL.values()]
    ranks = run_ranks("trl_rl_workers:suite_ranks", 2, {"runs": runs, "out": str(tmp_path / "o")}, tmp_path / "h",
                      deadline_s=560)
    for k, name in enumerate(VLLM_GLOBAL):
        check_moved(ranks, k, name)
        for r in ranks:
            assert correction_bit(r[k]["ref"]["logs"], runs[k]["vllm"]), name
    assert mixed_micro_batches(ranks[0][list(VLLM_GLOBAL).index("bnpo_token_mask_entropy")]["odb"]["plans"], 4) > 0
    assert np.isfinite([r[0]["odb"]["losses"] for r in ranks]).all()


def test_rloo_with_vllm_is_accepted_and_cut_as_without(tmp_path):
    # RLOO takes vLLM's completions only (no sampling log-probabilities, no correction): its rollouts hold the same
    # keys as with TRL's own generation, which the every-loss-type runs train against TRL.
    trainer = R.build(dict(trainer="rloo"), str(tmp_path), R.GradRecorder())
    trainer.use_vllm = True
    keys = odb_trl.enable_odb(trainer, token_budget=BUDGET).odb_rl.keys
    assert "importance_sampling_ratio" not in keys.layouts and keys.kind("old_logps") == ROW
