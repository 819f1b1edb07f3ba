"""odb.scale_loss: the documented loss recipe stays finite and exact on micro-batches without supervised tokens.

Unit tests in one process, then 2 real gloo ranks under DDP (tests/support/loss_workers.py):
every fourth sample has no supervised token and is longer than the rest, so odb
groups those samples into micro-batches whose mean loss is 0 / 0.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import odb
from dist_harness import run_ranks
from odb.train.loss import zero_loss

import loss_workers


def info_of(local_tokens: int, scale: float, ghost: bool = False) -> odb.ODBStepInfo:
    return odb.ODBStepInfo(micro_batch=0, epoch=0, local_samples=0 if ghost else 2, all_samples_this_step=4,
                           local_loss_tokens=local_tokens, global_loss_tokens=20, real_tokens=10,
                           padded_tokens=12, loss_scale=scale, is_ghost=ghost)


def masked_batch_loss(model: torch.nn.Module, kind: str) -> torch.Tensor:
    """A batch of two samples, every label ignored."""
    batch = {"input_ids": torch.tensor([[1, 2, 3], [4, 5, 0]]), "labels": torch.full((2, 3), -100)}
    return loss_workers.token_mean_loss(model, batch, kind)


@pytest.mark.parametrize("kind", ["torch", "ratio"])
def test_no_supervised_token_gives_an_exact_zero_and_zero_gradients(kind):
    model = loss_workers.lm_model(0)
    loss = masked_batch_loss(model, kind)
    assert math.isnan(float(loss.detach()))  # the hazard: the mean over 0 tokens
    scaled = odb.scale_loss(loss, info_of(0, 0.0))
    assert float(scaled) == 0.0 and scaled.dtype == loss.dtype and scaled.shape == loss.shape
    scaled.backward()
    for param in model.parameters():  # every parameter the loss uses gets a gradient, all zeros
        assert param.grad is not None and torch.equal(param.grad, torch.zeros_like(param))


def test_the_plain_recipe_is_nan_there():
    # What scale_loss replaces: NaN x 0 is NaN, and sum / count backpropagates NaN.
    model = loss_workers.lm_model(0)
    plain = masked_batch_loss(model, "ratio") * 0.0
    plain.backward()
    assert math.isnan(float(plain))
    assert any(torch.isnan(p.grad).any() for p in model.parameters())


def test_supervised_batches_are_scaled_as_before():
    model = loss_workers.lm_model(0)
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, -100, 3]])}
    loss = loss_workers.token_mean_loss(model, batch, "torch")
    assert torch.equal(odb.scale_loss(loss, info_of(2, 0.75)), loss * 0.75)
    assert torch.equal(odb.scale_loss(loss, info_of(2, 0.75), factor=4), loss * 3.0)


def test_ghost_batches_get_a_zero_with_gradients():
    model = loss_workers.lm_model(0)
    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "labels": torch.tensor([[1, 2, 3]])}
    loss = loss_workers.token_mean_loss(model, batch, "torch")
    zero = odb.scale_loss(loss, info_of(3, 0.0, ghost=True))
    zero.backward()
    assert float(zero) == 0.0
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())


def test_zero_keeps_shape_dtype_and_handles_losses_without_graph():
    w = torch.ones(3, requires_grad=True)
    per_row = (w * torch.tensor([0.0, 0.0, 0.0])) / torch.tensor(0.0)  # a non-scalar NaN loss
    zero = odb.scale_loss(per_row.to(torch.bfloat16), info_of(0, 0.0))
    assert zero.shape == (3,) and zero.dtype == torch.bfloat16 and not zero.any()
    zero.sum().backward()
    assert torch.equal(w.grad, torch.zeros(3))
    no_graph = odb.scale_loss(torch.tensor(float("nan")), info_of(0, 0.0))  # evaluation, no grad
    assert float(no_graph) == 0.0 and not no_graph.requires_grad
    leaf = torch.tensor(float("nan"), requires_grad=True)  # the loss is itself a leaf
    odb.scale_loss(leaf, info_of(0, 0.0)).backward()
    assert float(leaf.grad) == 0.0


def test_non_reentrant_checkpointing_reaches_every_parameter():
    from torch.utils.checkpoint import checkpoint

    model = loss_workers.lm_model(0)
    ids = torch.tensor([[1, 2, 3]])
    logits = checkpoint(model, ids, use_reentrant=False).reshape(-1, loss_workers.VOCAB)
    loss = F.cross_entropy(logits, torch.full((3,), -100), ignore_index=-100)
    odb.scale_loss(loss, info_of(0, 0.0)).backward()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_bad_arguments_name_the_fix():
    info = info_of(2, 1.0)
    with pytest.raises(TypeError, match=r"scale_loss got loss of type float.*Fix: pass model\(\*\*batch\)\.loss"):
        odb.scale_loss(2.0, info)
    with pytest.raises(TypeError, match=r"scale_loss got info of type dict.*odb.pop_step_info\(batch\)"):
        odb.scale_loss(torch.tensor(1.0), {"loss_scale": 1.0})


def test_hf_zero_without_logits_has_no_nan_gradient():
    model = loss_workers.lm_model(0)
    loss = masked_batch_loss(model, "ratio")
    zero = zero_loss(loss, {"loss": loss})  # a model output without logits
    zero.backward()
    assert float(zero) == 0.0
    assert all(not torch.isnan(p.grad).any() for p in model.parameters())
    logits = torch.full((2, 3), float("inf"), requires_grad=True)  # exact zero even from infinite logits
    assert float(zero_loss(torch.tensor(float("nan")), {"logits": logits})) == 0.0


def _max_rel_error(got, ref) -> float:
    scale = max(float(r.abs().max()) for r in ref) or 1.0
    return max(float((g - r).abs().max()) for g, r in zip(got, ref)) / scale


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_masked_micro_batches_under_two_ranks(tmp_path):
    """DDP, 2 gloo ranks: with scale_loss every optimizer step's gradient equals the one-process reference
    (the token mean over the step's samples, zero when none is supervised) and nothing is NaN; the plain
    recipe on the same data gives NaN (sum / count) or NaN logged losses (torch's mean)."""
    params = {"n": 96, "budget": 72, "buffer": 24, "kinds": ["torch", "ratio"],
              "recipes": ["scale_loss", "plain"], "accumulation": [1, 2]}
    ranks = run_ranks("loss_workers:masked_training", 2, params, tmp_path, deadline_s=100)
    for k in params["accumulation"]:
        for kind in params["kinds"]:
            steps = [r[f"{kind}/scale_loss/{k}"] for r in ranks]
            assert len(steps[0]) == len(steps[1]) > 3
            micro = [m for s in steps for step in s for m in step["micro"]]
            masked = [m for m in micro if m["local"] == 0 and not m["ghost"]]
            assert masked, "the data must give micro-batches without supervised tokens"
            assert any(m["global"] > 0 for m in masked), "...next to supervised micro-batches of the same step"
            assert all(m["logged"] == 0.0 for m in masked)
            assert all(math.isfinite(m["logged"]) for m in micro)
            ids = sorted(i for s in steps for step in s for i in step["ids"])
            assert ids == list(range(params["n"]))
            for a, b in zip(*steps):
                for g0, g1 in zip(a["grads"], b["grads"]):
                    assert not torch.isnan(g0).any()
                    assert torch.allclose(g0, g1, rtol=0, atol=1e-12)  # DDP averaged the same gradient
                ref = loss_workers.reference_grads(params, a["ids"] + b["ids"])
                assert _max_rel_error(a["grads"], ref) < 1e-9
        # The hazard the helper removes, on the same batches:
        ratio = [step for r in ranks for step in r[f"ratio/plain/{k}"]]
        assert any(torch.isnan(g).any() for step in ratio for g in step["grads"])
        plain = [m for r in ranks for step in r[f"torch/plain/{k}"] for m in step["micro"]]
        assert any(math.isnan(m["logged"]) for m in plain)
