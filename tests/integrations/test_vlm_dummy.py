"""odb's dummy image for image-less micro-batches (odb.integrations.vlm) adds exactly zero, on the real models.

For each model odb knows (Qwen2-VL, Qwen2.5-VL, Qwen3-VL and LLaVA from odb.bench.vlm_data,
float64): a padded text-only batch trains to the same loss and gradients
with the dummy as without it, and the vision tower's gradients exist and are exact zeros. With
a free padding slot the batch keeps its shape and everything is bitwise equal; a batch without
one gets a column, and agrees to float32-rotary precision (the models compute rotary angles in
float32, whose cos/sin differ by an ulp with the tensor's width). One process, no collectives.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest
import torch

from odb.bench import vlm_data as V
from odb.integrations.vlm import VisionDummyCollate, dummy_image_for, imageless_guard

VISION = ("visual", "vision_tower", "multi_modal_projector")


def build(kind: str) -> torch.nn.Module:
    return V.build_model(kind, dtype=torch.float64)


def text_batch(free_slot: bool) -> Dict[str, torch.Tensor]:
    """Two rows of text (ids 10-39: plain words), right-padded when ``free_slot``; the first three tokens
    unsupervised."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(10, 40, (2, 9), generator=g)  # plain words of every vocabulary here, no special token
    mask = torch.ones_like(ids)
    if free_slot:
        mask[1, 6:] = 0
        ids[1, 6:] = 0
    labels = ids.clone()
    labels[:, :3] = -100
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def loss_and_grads(model: torch.nn.Module, batch: Dict[str, Any]) -> tuple:
    model.zero_grad(set_to_none=True)
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), {n: w.grad.clone() for n, w in model.named_parameters() if w.grad is not None}


@pytest.mark.parametrize("kind", ["qwen2_vl", "llava", "qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("free_slot", [True, False], ids=["slot", "column"])
def test_dummy_image_adds_exactly_zero(kind, free_slot):
    model = build(kind)
    dummy = dummy_image_for(model)
    assert dummy is not None and dummy.family == kind
    plain = text_batch(free_slot)
    collate = VisionDummyCollate(lambda samples: dict(plain), dummy)
    batch = collate([None])
    assert batch["pixel_values"].shape == dummy.pixel_shape
    assert int((batch["input_ids"] == dummy.image_token_id).sum()) == dummy.tokens
    widened = batch["input_ids"].shape[1] - plain["input_ids"].shape[1]
    free = int(((plain["attention_mask"] == 0) & (plain["labels"] == -100)).sum())  # 3 slots, or none
    assert widened == max(0, -(-(dummy.tokens - free) // 2)), "columns only for the tokens without a slot"
    loss, grads = loss_and_grads(model, plain)
    loss_d, grads_d = loss_and_grads(model, batch)
    vision = [n for n in grads_d if any(part in n for part in VISION)]
    assert vision and all(not any(part in n for part in VISION) for n in grads), "the dummy must run the vision path"
    assert all(float(grads_d[n].abs().max()) == 0.0 for n in vision), "vision gradients must be exact zeros"
    if widened == 0:
        assert torch.equal(loss, loss_d) and all(torch.equal(grads[n], grads_d[n]) for n in grads)
    else:
        scale = max(float(g.abs().max()) for g in grads.values())
        assert float((loss - loss_d).abs()) <= 1e-6 * float(loss.abs())
        assert max(float((grads[n] - grads_d[n]).abs().max()) for n in grads) <= 1e-6 * scale


def test_which_batches_get_the_guard():
    qwen = build("qwen2_vl")
    assert imageless_guard(list, qwen, world_size=1, ddp_finds_unused=False) is list  # one process: no collective
    assert imageless_guard(list, torch.nn.Linear(2, 2), world_size=2, ddp_finds_unused=False) is list  # no vision
    assert imageless_guard(list, qwen, world_size=2, ddp_finds_unused=True) is list  # DDP tolerates a skip
    assert isinstance(imageless_guard(list, qwen, world_size=2, ddp_finds_unused=False), VisionDummyCollate)

    class Unknown(torch.nn.Module):  # a VLM odb has no dummy for
        config = type("Config", (), {"vision_config": object(), "model_type": "other_vlm", "image_token_id": 5})()

    assert imageless_guard(list, Unknown(), world_size=2, ddp_finds_unused=True) is list  # DDP tolerates it
    guard = imageless_guard(lambda s: {"input_ids": torch.ones(1, 3, dtype=torch.long)}, Unknown(), world_size=2,
                            ddp_finds_unused=False)
    with pytest.raises(ValueError, match=r"Unknown holds no image.*Fix: under DDP, set TrainingArguments\("
                                         r"ddp_find_unused_parameters=True\)"):
        guard([None])
    images = {"input_ids": torch.ones(1, 3, dtype=torch.long), "pixel_values": torch.ones(4, 3)}
    assert VisionDummyCollate(lambda s: images, None)([None]) is images  # a batch with images passes untouched
    packed = {"input_ids": torch.ones(1, 5, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1]])}
    with pytest.raises(ValueError, match="packed row .* Fix: layout='padded'"):
        VisionDummyCollate(lambda s: packed, dummy_image_for(qwen))([None])
