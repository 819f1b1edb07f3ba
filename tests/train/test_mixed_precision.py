"""Mixed precision and gradient checkpointing: odb's loss scaling stays exact.

A plain training loop over an odb loader (tests/support/precision_workers.py) with 2 micro-batches
per optimizer step, in one process and on 2 real gloo ranks under DDP (rank 1 holds a few
short samples and runs ghost steps). Each optimizer step's gradient, as the optimizer sees
it, is compared with a reference computed the same way (same model, same precision, same
GradScaler scale, same checkpointing) without odb: one process, one batch of every sample
of the step, (sum of per-token losses) / (their supervised tokens).

Error: max |odb - reference| over every parameter element / max |reference|.

Tolerances, and why they are not float64's:
- bf16 autocast: bf16 keeps 8 significant bits (unit roundoff 2^-9 = 2.0e-3). A gradient
  element passes through several bf16 roundings (the linear layers' outputs in forward and
  backward), and the reference rounds the weight gradient of one big batch once where the
  loop rounds one per micro-batch (and DDP sums in another order). Measured: 5.8e-3 (one
  process), 3.8e-3 (2 ranks). Tolerance 2e-2 (10 roundoffs).
- fp16 autocast + GradScaler: 11 significant bits (2^-11 = 4.9e-4). Measured 4.3e-4 / 4.8e-4.
  Tolerance 3e-3.
- float64 (TinyLM under gradient checkpointing): only the summation order differs. Measured
  1.3e-15. Tolerance 1e-10.
- a tiny HF Llama in float64 under HF's gradient checkpointing: HF computes the loss in
  float32 (logits.float()) on both sides. Measured 1.4e-7. Tolerance 1e-6.
The wrong recipes on the same data miss by 0.28 (a mean of micro-batch means) to 2.8 (the
local token count instead of the global one under 2 ranks): every mixed-precision test
asserts that its wrong recipe misses by at least 5x the tolerance, so the comparison can
fail. Under checkpointing the old odb.scale_loss failed outright (see the tests).
"""

from __future__ import annotations

import functools
import math
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import odb
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
        ref = W.reference_grads(p, a, step)
        if not any(r.any() for r in ref):  # no supervised token in the whole step: exactly zero
            assert not any(g.any() for g in step["grads"]), name
            continue
        errors.append(rel_error(step["grads"], ref))
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
            if any(g.any() for g in s["grads"]):  # a step without supervised tokens has nothing to change
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


def test_fp16_scaler_skips_no_step_for_micro_batches_without_supervised_tokens():
    """fp16 + GradScaler, one process, every fourth sample without supervised tokens (odb groups them, so some
    micro-batches have none), a custom loop's loss sum / count (0/0 there). With odb.scale_loss the scaler
    finds no inf, no step is skipped and every step is exact; loss * loss_scale there backpropagates NaN:
    unscale_ finds it, the step is skipped and the scale halved."""
    right, wrong = arm("fp16", loss="ratio"), arm("fp16", recipe="multiply", loss="ratio")
    p = dict(DATA, masked=True, arms=[right, wrong])
    ranks = [W.train(0, 1, p)]
    micro = [m for s in ranks[0][W.arm_name(right)] for m in s["micro"]]
    assert any(m["local"] == 0 for m in micro), "the data must give micro-batches without supervised tokens"
    check_training(right, ranks)
    errors = step_errors(p, right, ranks)
    assert max(errors) < TOLERANCE["fp16"], errors
    skipped = [s for s in ranks[0][W.arm_name(wrong)] if s["scale_after"] < s["scale"]]
    assert skipped and not any(s["stepped"] for s in skipped)
    print(f"\nfp16 with masked micro-batches: max error {max(errors):.2e}, no step skipped; loss * loss_scale: "
          f"{len(skipped)} step(s) skipped by the scaler")


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


# ---- gradient checkpointing ---------------------------------------------------------------------


def info_of(local_tokens: int, scale: float, ghost: bool) -> odb.ODBStepInfo:
    return odb.ODBStepInfo(micro_batch=0, epoch=0, local_samples=0 if ghost else 2, all_samples_this_step=4,
                           local_loss_tokens=local_tokens, global_loss_tokens=20, real_tokens=10,
                           padded_tokens=12, loss_scale=scale, is_ghost=ghost)


def tiny_batch(supervised: bool) -> Dict[str, torch.Tensor]:
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0]])
    return {"input_ids": ids, "labels": ids.clone() if supervised else torch.full_like(ids, -100)}


CHECKPOINTED = {  # how a loop hands TinyLM's block to a reentrant checkpoint
    "module": lambda net: net.block,
    "closure": lambda net: (lambda hidden: net.block(hidden)),
    "partial": lambda net: functools.partial(type(net.block).forward, net.block),
    "weights": lambda net: over_weights(net.block[0].weight, net.block[0].bias, net.block[2]),
    "defaults": lambda net: (lambda hidden, w=net.block[0].weight, b=net.block[0].bias, block=net.block[2]:
                             block(F.gelu(F.linear(hidden, w, b)))),
}


def over_weights(w: torch.Tensor, b: torch.Tensor, block: torch.nn.Module) -> Any:
    """A closure over a weight and a bias tensor (and a module)."""
    return lambda hidden: block(F.gelu(F.linear(hidden, w, b)))


@pytest.mark.parametrize("form", sorted(CHECKPOINTED))
@pytest.mark.parametrize("supervised", [True, False], ids=["ghost", "no-supervised-token"])
def test_zero_loss_reaches_the_parameters_inside_a_reentrant_checkpoint(form, supervised):
    """The parameters a reentrant checkpoint runs are not in the graph before backward. A ghost (a real sample:
    finite loss) and a micro-batch without supervised tokens (NaN loss, 0/0) must still give each of them an
    exact zero gradient, or DDP's all-reduce waits for them (before the fix: no gradient, grad None)."""
    net = W.make_model("fp64")
    batch = tiny_batch(supervised)
    hidden = checkpoint(CHECKPOINTED[form](net), net.embed(batch["input_ids"]), use_reentrant=True)
    loss = F.cross_entropy(net.head(hidden).reshape(-1, W.VOCAB), batch["labels"].reshape(-1), ignore_index=-100)
    assert math.isfinite(float(loss.detach())) == supervised
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # none of these forms may warn
        zero = odb.scale_loss(loss, info_of(8 if supervised else 0, 0.0, ghost=supervised))
    zero.backward()
    assert float(zero.detach()) == 0.0
    for name, param in net.named_parameters():
        assert param.grad is not None, f"{name} got no gradient"
        assert torch.equal(param.grad, torch.zeros_like(param)), name


GLOBAL_BLOCK = torch.nn.Linear(16, 16).double()


def _through_a_global(hidden: torch.Tensor) -> torch.Tensor:
    return GLOBAL_BLOCK(hidden)


def test_a_checkpointed_function_without_visible_weights_is_named_in_a_warning():
    net = W.make_model("fp64")
    batch = tiny_batch(False)
    hidden = checkpoint(_through_a_global, net.embed(batch["input_ids"]), use_reentrant=True)
    loss = F.cross_entropy(net.head(hidden).reshape(-1, W.VOCAB), batch["labels"].reshape(-1), ignore_index=-100)
    with pytest.warns(UserWarning, match=r"(?s)loss is NaN or infinite.*_through_a_global.*use_reentrant=True.*"
                                         r"Fix: checkpoint with use_reentrant=False"):
        zero = odb.scale_loss(loss, info_of(0, 0.0, ghost=False))
    zero.backward()
    assert torch.equal(net.head.weight.grad, torch.zeros_like(net.head.weight))  # the rest still gets its zero


@pytest.mark.parametrize("supervised", [True, False], ids=["ghost", "no-supervised-token"])
def test_hf_llama_reentrant_checkpointing_zero_reaches_every_layer(supervised):
    """HF's checkpointed layers hand torch a functools.partial of the layer's forward: a ghost's zero (finite
    loss) and a NaN loss's zero give every trainable parameter of a tiny Llama a zero gradient."""
    import hf_workers

    model = W.hf_model({"checkpointing": "reentrant"})
    sample = hf_workers.causal_sample(0, 9, unsupervised=not supervised)
    loss = model(**hf_workers.pad_collate([sample])).loss
    assert math.isfinite(float(loss.detach())) == supervised
    odb.scale_loss(loss, info_of(5 if supervised else 0, 0.0, ghost=supervised)).backward()
    missing = [n for n, t in model.named_parameters() if t.grad is None]
    assert not missing, f"no gradient for {missing}"
    assert all(not t.grad.any() for t in model.parameters())


def check_checkpointed(p: Dict[str, Any], ranks: List[Dict[str, Any]], arms: List[Dict[str, Any]], reference: Any,
                       tolerance: float) -> None:
    for a in arms:
        name = W.arm_name(a)
        per_rank = [r[name] for r in ranks]
        micro = [m for steps in per_rank for s in steps for m in s["micro"]]
        ghosts = [sum(m["ghost"] for s in steps for m in s["micro"]) for steps in per_rank]
        assert ghosts[0] == 0 and ghosts[1] > 0, ghosts
        assert any(m["local"] == 0 and not m["ghost"] for m in micro), "the data must give masked micro-batches"
        assert all(math.isfinite(m["logged"]) for m in micro)
        ids = sorted(i for steps in per_rank for s in steps for i in s["ids"])
        assert ids == list(range(sum(p["counts"])))
        errors = []
        for column in zip(*per_rank):
            for other in column[1:]:
                assert all(torch.equal(g0, g1) for g0, g1 in zip(column[0]["grads"], other["grads"])), name
            assert all(torch.isfinite(g).all() for g in column[0]["grads"])
            step = dict(column[0], ids=[i for s in column for i in s["ids"]])
            ref = reference(p, a, step)
            if not any(r.any() for r in ref):  # no supervised token in the whole step: exactly zero
                assert not any(g.any() for g in step["grads"]), name
                continue
            errors.append(rel_error(step["grads"], ref))
        assert errors and max(errors) < tolerance, (name, errors)
        print(f"\n{name}, 2 ranks: max error {max(errors):.2e} over {len(errors)} optimizer steps (tolerance "
              f"{tolerance:.0e}); ghost micro-batches on rank 1: {ghosts[1]}, without supervised tokens: "
              f"{sum(m['local'] == 0 and not m['ghost'] for m in micro)}")


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_checkpointing_with_ghost_steps_under_ddp(tmp_path):
    """TinyLM's block under reentrant and non-reentrant checkpointing, float64, 2 gloo ranks under DDP, 2
    micro-batches per step, odb.scale_loss: rank 1's ghost steps and rank 0's micro-batches without supervised
    tokens still reach the checkpointed parameters (before the fix, reentrant failed: DDP raised 'Expected to
    have finished reduction in the prior iteration' on one rank while the other waited), and every optimizer
    step's gradient equals the reference (tolerance 1e-10: float64, only the summation order differs)."""
    arms = [arm("fp64", checkpointing=kind) for kind in ("reentrant", "non_reentrant")]
    p = dict(DATA, masked=True, arms=arms)
    ranks = run_ranks("precision_workers:train", 2, p, tmp_path, deadline_s=100)
    check_checkpointed(p, ranks, arms, W.reference_grads, TOLERANCE["fp64"])


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_hf_llama_gradient_checkpointing_with_ghost_steps_under_ddp(tmp_path):
    """A tiny Llama (random weights, float64) with HF's gradient checkpointing, reentrant and not, and reentrant
    with frozen input embeddings (enable_input_require_grads), in a plain loop with odb.scale_loss(model(**batch)
    .loss, info) on 2 gloo ranks under DDP with ghost steps and micro-batches without supervised tokens: the run
    completes and each step's gradient equals HF's loss over the step's samples in one batch (tolerance 1e-6:
    HF computes the loss in float32; measured 1.4e-7)."""
    arms = [{"checkpointing": "reentrant", "frozen_embeddings": False, "recipe": "scale_loss"},
            {"checkpointing": "non_reentrant", "frozen_embeddings": False, "recipe": "scale_loss"},
            {"checkpointing": "reentrant", "frozen_embeddings": True, "recipe": "scale_loss"}]
    p = {"counts": [24, 3], "budget": 96, "buffer": 16, "lr": 0.1, "masked": True, "arms": arms}
    ranks = run_ranks("precision_workers:hf_train", 2, p, tmp_path, deadline_s=130)
    check_checkpointed(p, ranks, arms, W.hf_reference_grads, 1e-6)
