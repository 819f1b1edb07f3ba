"""Mixed precision and gradient checkpointing: odb's loss scaling stays exact.

A plain training loop over an odb loader (tests/precision_workers.py) with 2 micro-batches
per optimizer step, in one process and on 2 real gloo ranks under DDP (rank 1 holds a few
short samples and runs ghost steps). Each optimizer step's gradient, as the optimizer sees
it, is compared with a reference computed the same way (same model, same precision, same
GradScaler scale) without odb: one process, one batch of every sample of the step, (sum of
per-token losses) / (their supervised tokens).

Error: max |odb - reference| over every parameter element / max |reference|.

Tolerances, and why they are not float64's:
- bf16 autocast: bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2.0e-3). A gradient
  element passes through several bf16 roundings (the linear layers' outputs in forward and
  backward), and the reference rounds the weight gradient of one big batch once where the
  loop rounds one per micro-batch (and DDP sums in another order). Measured: 5.8e-3 (one
  process), 3.8e-3 (2 ranks). Tolerance 2e-2 (10 roundoffs).
- fp16 autocast + GradScaler: 11 significant bits (2^-11 = 4.9e-4). Measured 4.3e-4 / 4.8e-4.
  Tolerance 3e-3.
- float64 (the checkpointing tests): only the summation order differs. Measured below 1e-15.
  Tolerance 1e-10.
The wrong recipes on the same data miss by 0.28 (a mean of micro-batch means) to 2.8 (the
local token count instead of the global one under 2 ranks): every test asserts that its
wrong recipe misses by at least 5x the tolerance, so the comparison can fail.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List

import pytest
import torch

import precision_workers as W
from dist_harness import run_ranks

TOLERANCE = {"bf16": 2e-2, "fp16": 3e-3, "fp64": 1e-10}
DATA = {"counts": [40, 5], "budget": 128, "buffer": 16, "lr": 0.1}  # 40 long samples, 5 short ones (rank 1's)


def rel_error(got: List[torch.Tensor], ref: List[torch.Tensor]) -> float:
    scale = max(float(r.abs().max()) for r in ref)
    return max(float((g - r).abs().max()) for g, r in zip(got, ref)) / scale


def arm(precision: str, recipe: str = "scale_loss", loss_scaling: str = "exact", **extra: Any) -> Dict[str, Any]:
    return dict(precision=precision, recipe=recipe, loss_scaling=loss_scaling, accumulation=2, **extra)


def step_errors(p: Dict[str, Any], a: Dict[str, Any], ranks: List[Dict[str, Any]]) -> List[float]:
    """Per optimizer step: the error of rank 0's gradient against the reference over every rank's samples."""
    name = W.arm_name(a)
    per_rank = [r[name] for r in ranks]
    assert len({len(steps) for steps in per_rank}) == 1, f"{name}: step counts differ {[len(s) for s in per_rank]}"
    errors = []
    for column in zip(*per_rank):
        for other in column[1:]:  # DDP left the same averaged gradient on every rank
            assert all(torch.equal(g0, g1) for g0, g1 in zip(column[0]["grads"], other["grads"])), name
        step = dict(column[0], ids=[i for s in column for i in s["ids"]])
        errors.append(rel_error(step["grads"], W.reference_grads(p, a, step)))
    return errors


def check_training(a: Dict[str, Any], ranks: List[Dict[str, Any]]) -> None:
    """Every sample once; finite losses and gradients; every step taken; fp16: the scaler found no inf."""
    per_rank = [r[W.arm_name(a)] for r in ranks]
    ids = sorted(i for steps in per_rank for s in steps for i in s["ids"])
    assert ids == list(range(sum(DATA["counts"])))
    for steps in per_rank:
        assert len(steps) >= 4
        for s in steps:
            assert all(math.isfinite(m["logged"]) for m in s["micro"])
            assert all(m["logged"] == 0.0 for m in s["micro"] if m["ghost"])
            assert all(torch.isfinite(g).all() for g in s["grads"])
            assert s["stepped"], "the optimizer step changed no parameter (a skipped GradScaler step?)"
            if a["precision"] == "fp16":  # unscale_ found no inf/NaN: the scale was not backed off
                assert s["scale_after"] == s["scale"] == 65536.0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_one_process_with_accumulation_matches_the_same_precision_reference(precision):
    right, wrong = arm(precision), arm(precision, recipe="divide")
    p = dict(DATA, arms=[right, wrong])
    ranks = [W.train(0, 1, p)]
    check_training(right, ranks)
    errors = step_errors(p, right, ranks)
    assert max(errors) < TOLERANCE[precision], errors
    missed = max(step_errors(p, wrong, ranks))
    assert missed > 5 * TOLERANCE[precision], f"the data cannot tell a mean of micro-batch means ({missed:.2e})"
    print(f"\n{precision}, 1 process, 2 micro-batches: max error {max(errors):.2e} over {len(errors)} optimizer "
          f"steps (tolerance {TOLERANCE[precision]:.0e}); a mean of micro-batch means misses by {missed:.2e}")


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_two_ranks_ddp_with_ghost_steps_match_the_same_precision_reference(tmp_path):
    """bf16 autocast and fp16 autocast + GradScaler on 2 gloo ranks under DDP, 2 micro-batches per step, rank 1
    running ghost steps: exact against the reference with odb.scale_loss and with loss * loss_scale; the
    scaler's inf check passes every step (a ghost adds an exact zero, never inf/NaN) and no step is skipped.
    loss_scaling="approx" (each rank's own token count) misses on the same data."""
    right = [arm("bf16"), arm("fp16"), arm("fp16", recipe="multiply")]
    wrong = [arm("bf16", loss_scaling="approx"), arm("fp16", loss_scaling="approx")]
    p = dict(DATA, arms=right + wrong)
    ranks = run_ranks("precision_workers:train", 2, p, tmp_path, deadline_s=130)
    for a in right:
        name = W.arm_name(a)
        check_training(a, ranks)
        ghosts = [sum(m["ghost"] for s in r[name] for m in s["micro"]) for r in ranks]
        assert ghosts[0] == 0 and ghosts[1] > 0, ghosts
        errors = step_errors(p, a, ranks)
        assert max(errors) < TOLERANCE[a["precision"]], (name, errors)
        print(f"\n{name}, 2 ranks: max error {max(errors):.2e} over {len(errors)} optimizer steps "
              f"(tolerance {TOLERANCE[a['precision']]:.0e}); ghost micro-batches on rank 1: {ghosts[1]}")
    for a in wrong:
        missed = max(step_errors(p, a, ranks))
        assert missed > 5 * TOLERANCE[a["precision"]], f"{W.arm_name(a)}: the local token count passes ({missed})"
        print(f"{W.arm_name(a)}: misses by {missed:.2e}")
