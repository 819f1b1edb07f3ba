"""Packed rows with images (layout="packed"): real Qwen2-VL / Qwen2.5-VL / Qwen3-VL / LLaVA classes built from
configs, float64, a packed row against each sample alone; the refusals and the collate errors with their messages."""

from __future__ import annotations

from typing import Any, Dict, List

import pytest
import torch

import odb
from odb.bench.vlm_data import (IGNORE, PATCHES_KEY, QWEN_FAMILY, build_model, build_tokenizer, pad_collate,
                                vlm_samples)
from odb.data.collate_check import DroppedImagesError
from odb.loader.batch_checks import PackedBatchError
from odb.packed.attention import register_varlen_attention
from odb.packed.models import PackedLayoutError, check_packed_model


def _samples(name: str) -> List[Dict[str, Any]]:
    """Five samples: four with images (one with two), one text only (seed 2)."""
    samples = vlm_samples(name, 5, seed=2)
    images = [len(s.get("image_grid_thw", s.get("pixel_values", ()))) for s in samples]
    assert sum(i > 0 for i in images) >= 2 and 0 in images and 2 in images, images
    return samples


def _sum_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of one row, in the logits' dtype (HF's loss upcasts to float32 only)."""
    return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE, reduction="sum")


def _alone(sample: Dict[str, Any]) -> Dict[str, Any]:
    """A sample as a batch of one, as its processor made it (the model computes its own positions)."""
    return pad_collate([sample])


def _grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out


@pytest.mark.parametrize("name,attn", [(n, "sdpa") for n in QWEN_FAMILY + ("llava",)]
                         + [("qwen2_vl", "odb_varlen"), ("llava", "odb_varlen")])
def test_a_packed_row_with_images_trains_as_its_samples_alone(name: str, attn: str) -> None:
    if attn == "odb_varlen":
        register_varlen_attention()
    model = build_model(name, seed=0, dtype=torch.float64, attn_implementation=attn)
    samples = _samples(name)
    row = odb.PackedCollate.for_model(model)(samples)
    with_images = [s for s in samples if "pixel_values" in s]
    assert row["input_ids"].shape == (1, sum(len(s["input_ids"]) for s in samples))
    assert torch.equal(row["pixel_values"], torch.cat([s["pixel_values"] for s in with_images]))
    if name in QWEN_FAMILY:
        assert torch.equal(row["image_grid_thw"], torch.cat([s["image_grid_thw"] for s in with_images]))
        assert row["position_ids"].shape == (4, 1, row["input_ids"].shape[1])
    labels = row.pop("labels")[0]
    packed = model(**row).logits[0]
    loss = _sum_ce(packed, labels)
    loss.backward()
    packed_grads = _grads(model)
    total, start = torch.zeros((), dtype=torch.float64), 0
    for s in samples:
        batch = _alone(s)
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0]
        n = len(logits)
        assert torch.allclose(packed[start:start + n], logits, rtol=0, atol=1e-12), f"sample at {start}"
        start += n
        part = _sum_ce(logits, batch["labels"][0])
        part.backward()
        total = total + part.detach()
    alone_grads = _grads(model)
    assert torch.allclose(loss, total, rtol=1e-13, atol=0)
    assert packed_grads.keys() == alone_grads.keys()
    vision = [k for k in alone_grads if "visual" in k or "vision_tower" in k]
    assert vision and any(bool(alone_grads[k].abs().sum() > 0) for k in vision), "the vision tower trains"
    for key, grad in alone_grads.items():
        assert torch.allclose(packed_grads[key], grad, rtol=1e-9, atol=1e-12), key


def test_qwen2_vl_rows_hold_each_samples_own_3d_positions() -> None:
    model = build_model("qwen2_vl", seed=0)
    samples = _samples("qwen2_vl")
    row = odb.PackedCollate.for_model(model)(samples)
    start = 0
    for s in samples:
        n = len(s["input_ids"])
        alone = _alone(s)
        own, _ = model.model.get_rope_index(alone["input_ids"], alone["mm_token_type_ids"],
                                            image_grid_thw=alone.get("image_grid_thw"))
        assert torch.equal(row["position_ids"][1:, 0, start:start + n], own[:, 0])
        assert row["position_ids"][0, 0, start:start + n].tolist() == list(range(n))  # the sample boundaries
        start += n
    image = next(s for s in samples if "image_grid_thw" in s)
    rope = odb.PackedCollate.for_model(model).rope_index
    assert not torch.equal(rope(image["input_ids"], image_grid_thw=image["image_grid_thw"])[1],
                           torch.arange(len(image["input_ids"]))), "image tokens take 2-D places"


def test_qwen_vl_is_refused_without_its_3d_positions_and_the_message_names_the_fix() -> None:
    model = build_model("qwen2_vl", seed=0, dtype=torch.float64)
    with pytest.raises(PackedLayoutError, match=r"Qwen2VLForConditionalGeneration.*3-D \(mrope\).*images.*"
                                                r"Fix: collate with odb.PackedCollate.for_model\(model\)"):
        check_packed_model(model, odb.PackedCollate())
    samples = vlm_samples("qwen2_vl", 8, seed=2)
    with pytest.raises(ValueError, match=r"image_grid_thw.*3-D \(mrope\).*PackedCollate.for_model\(model\)"):
        odb.PackedCollate()(samples)
    text_only = [s for s in samples if "pixel_values" not in s]
    with pytest.raises(ValueError, match=r"carry mm_token_type_ids.*not made for the model"):
        odb.PackedCollate()(text_only)  # Qwen2-VL's text-only rows mix too without the 4-row position_ids
    assert odb.PackedCollate.for_model(model)(text_only)["position_ids"].shape[0] == 4
    assert check_packed_model(model, samples=vlm_samples("qwen2_vl", 6, seed=0)) < 1e-9  # the default: its rope


class _ReversedImages(odb.PackedCollate):
    """A collate that puts the row's images in the wrong order: what the image probe must catch."""

    def __call__(self, samples: Any) -> Dict[str, Any]:
        batch = super().__call__(samples)
        if "pixel_values" in batch:
            batch["pixel_values"] = batch["pixel_values"].flip(0)
        return batch


def test_vision_models_are_probed_with_real_images_or_refused() -> None:
    from transformers import LlavaForConditionalGeneration

    llava = build_model("llava", seed=0, dtype=torch.float64)
    samples = vlm_samples("llava", 6, seed=0)
    with pytest.raises(PackedLayoutError, match=r"LlavaForConditionalGeneration.*your samples with images "
                                                r"\(pixel_values\).*differ.*Fix: use layout='padded'"):
        check_packed_model(llava, _ReversedImages(), samples=samples)
    other = type("OtherVLM", (LlavaForConditionalGeneration,), {})(llava.config).to(torch.float64)
    with pytest.raises(PackedLayoutError, match=r"OtherVLM.*vision tower.*samples=\[dataset\[i\].*layout='padded'"):
        check_packed_model(other)
    assert check_packed_model(other, samples=samples) < 1e-9  # probed on real images: it packs


def test_a_collate_that_drops_the_images_is_an_error() -> None:
    samples = vlm_samples("llava", 12, seed=0)

    def text_only(group: List[Dict[str, Any]]) -> Dict[str, torch.Tensor]:
        return {k: v for k, v in pad_collate(group).items() if k != "pixel_values"}

    loader = odb.ODBDataLoader(samples, token_budget=256, collate_fn=text_only, buffer_size=12, shuffle=False)
    with pytest.raises(DroppedImagesError, match=r"collate_fn=text_only returned a batch without pixel_values, "
                                                 r"which \d+ of its \d+ samples carry.*Fix: collate the image fields"):
        list(loader)
    kept = odb.ODBDataLoader(samples, token_budget=256, collate_fn=pad_collate, buffer_size=12, shuffle=False)
    batches = [odb.pop_step_info(b) and b for b in kept]
    assert sum(len(b.get("pixel_values", ())) for b in batches) == sum(
        len(s["pixel_values"]) for s in samples if "pixel_values" in s)


def test_a_padded_batch_where_odb_planned_a_packed_row_is_an_error() -> None:
    samples = vlm_samples("llava", 12, seed=0)
    loader = odb.ODBDataLoader(samples, token_budget=256, layout="packed", collate_fn=pad_collate, buffer_size=12,
                               shuffle=False)
    with pytest.raises(PackedBatchError, match=r"odb planned a packed row of \d+ samples \(\d+ tokens.*returned "
                                               r"input_ids of shape \(\d+, \d+\).*Fix: collate with odb.PackedCollate"):
        list(loader)
    packed = odb.ODBDataLoader(samples, token_budget=256, layout="packed", buffer_size=12, shuffle=False,
                               image_patches_key=PATCHES_KEY, max_image_patches=64)
    image_id, seen = build_tokenizer("llava").convert_tokens_to_ids("<image>"), 0
    for batch in packed:  # the default collate of layout="packed": one row, the images kept
        info = odb.pop_step_info(batch)
        assert batch["input_ids"].shape == (1, info.padded_tokens) and info.padded_tokens <= 256
        images = len(batch["pixel_values"]) if "pixel_values" in batch else 0
        assert images * 16 <= 64 and images == int((batch["input_ids"] == image_id).sum()) // 16
        seen += info.local_samples
    assert seen == len(samples)


def test_the_trainer_refuses_qwen2_vl_packed_rows_at_setup_and_trains_them_with_its_rope(tmp_path: Any) -> None:
    from transformers import Trainer, TrainingArguments

    from odb.integrations.hf import enable_odb

    samples = vlm_samples("qwen2_vl", 8, seed=0)
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                             max_steps=2, save_strategy="no", logging_strategy="no")
    model = build_model("qwen2_vl", seed=0)
    plain = Trainer(model=model, args=args, train_dataset=samples, data_collator=odb.PackedCollate())
    with pytest.raises(PackedLayoutError, match=r"layout='packed' trains on packed rows, and odb refuses "
                                                r"layout='packed' for Qwen2VLForConditionalGeneration.*3-D \(mrope\)"
                                                r".*PackedCollate.for_model\(model\)"):
        enable_odb(plain, token_budget=256, layout="packed", buffer_size=8)
    trainer = enable_odb(Trainer(model=model, args=args, train_dataset=samples,
                                 data_collator=odb.PackedCollate.for_model(model)),
                         token_budget=256, layout="packed", buffer_size=8)
    trainer.train()
    assert all(i.padded_tokens <= 256 for i in trainer.odb_step_infos)
