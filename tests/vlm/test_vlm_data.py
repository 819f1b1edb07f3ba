"""odb.bench.vlm_data: the tiny VLMs, their real processors and the chat samples everyone's VLM tests use."""

from __future__ import annotations

import pytest
import torch

from odb.bench.vlm_data import IGNORE, MODELS, PATCHES_KEY, build_model, build_tokenizer, pad_collate, vlm_samples


@pytest.mark.parametrize("name", MODELS)
def test_samples_are_processed_chats_with_images(name: str) -> None:
    samples = vlm_samples(name, 16, seed=3)
    again = vlm_samples(name, 16, seed=3)
    with_images = [s for s in samples if "pixel_values" in s]
    assert 4 <= len(with_images) <= 12, "about half the samples carry images"
    tok = build_tokenizer(name)
    image_id = tok.convert_tokens_to_ids("<|image_pad|>" if name == "qwen2_vl" else "<image>")
    for s, t in zip(samples, again):
        assert torch.equal(s["input_ids"], t["input_ids"]) and s[PATCHES_KEY] == t[PATCHES_KEY]  # seeded
        ids, labels = s["input_ids"], s["labels"]
        assert ids.dim() == 1 and labels.shape == ids.shape and bool(s["attention_mask"].all())
        answer = labels != IGNORE
        first = int(answer.int().argmax())
        assert 0 < first and bool(answer[first:].all()), "the prompt is masked, the answer supervised"
        assert torch.equal(labels[answer], ids[answer]) and int(labels[-1]) == tok.eos_token_id
        tokens = int((ids == image_id).sum())
        assert not bool((ids[first:] == image_id).any())
        if "pixel_values" not in s:
            assert tokens == 0 and s[PATCHES_KEY] == 0
        elif name == "qwen2_vl":
            grid = s["image_grid_thw"]
            assert 1 <= len(grid) <= 2 and s[PATCHES_KEY] == int(grid.prod(-1).sum()) == len(s["pixel_values"])
            assert tokens == s[PATCHES_KEY] // 4  # 2 x 2 patches merge into one token
            assert torch.equal(s["mm_token_type_ids"].bool(), ids == image_id)
        else:
            images = len(s["pixel_values"])
            assert 1 <= images <= 2 and tuple(s["pixel_values"].shape[1:]) == (3, 16, 16)
            assert tokens == s[PATCHES_KEY] == 16 * images
    if name == "qwen2_vl":  # random sizes: images of different patch counts
        assert len({tuple(g.tolist()) for s in with_images for g in s["image_grid_thw"]}) > 2


@pytest.mark.parametrize("name", MODELS)
def test_models_train_on_a_padded_batch(name: str) -> None:
    samples = vlm_samples(name, 6, seed=1)
    assert any("pixel_values" in s for s in samples) and not all("pixel_values" in s for s in samples)
    batch = pad_collate(samples)
    assert batch["input_ids"].shape == batch["labels"].shape == (6, max(len(s["input_ids"]) for s in samples))
    assert len(batch["pixel_values"]) == sum(len(s["pixel_values"]) for s in samples if "pixel_values" in s)
    model = build_model(name, seed=0, dtype=torch.float64)
    out = model(**batch)
    assert torch.isfinite(out.loss) and out.logits.dtype == torch.float64
    out.loss.backward()
    vision = [p for n, p in model.named_parameters() if "visual" in n or "vision_tower" in n
              or "projector" in n]
    assert vision and any(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in vision)
    text = model.get_input_embeddings().weight.grad
    assert text is not None and bool(text.abs().sum() > 0)
    # padding changes nothing: a sample's loss in a padded batch equals its loss alone (float64 logits)
    def token_mean(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits[:-1], labels[1:], ignore_index=IGNORE)

    short, long = sorted(samples, key=lambda s: len(s["input_ids"]))[::len(samples) - 1]
    one = pad_collate([short])
    two = pad_collate([short, long])
    alone = token_mean(model(**one).logits[0], one["labels"][0])
    padded = token_mean(model(**two).logits[0], two["labels"][0])
    assert two["input_ids"].shape[1] > one["input_ids"].shape[1]
    assert torch.allclose(padded, alone, rtol=1e-10, atol=0)
