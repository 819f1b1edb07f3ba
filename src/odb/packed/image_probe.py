"""Does a vision-language model train a packed row with images exactly? A probe on real samples, or a refusal.

A packed row keeps its samples' images (``odb.packed.vision``): per-image tensors
concatenated in row order, and, for the Qwen2-VL family, each sample's own 3-D
positions. That is exact for a model whose vision tower encodes each image alone and
whose image inputs carry no per-sample batch dimension: measured for
``VERIFIED_VLMS`` (tests/vlm). Other vision-language models may not be (a
``pixel_values`` batch dimension per sample, image tokens that attend both ways,
cross-attention to the images of the whole batch), so ``image_refusal`` runs the model on
a packed row of real samples with images and on each sample alone, and refuses the
model when the logits differ, or, with no such samples to try, when it is not one of
``VERIFIED_VLMS``. ``odb.check_packed_model`` raises the refusal.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from odb.data.vision_fields import IMAGE_FIELDS, TOKEN_FIELDS, image_fields
from odb.packed.vision import unwrap

# Model classes whose packed rows with images tests/vlm compares against each sample alone.
VERIFIED_VLMS = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration",
                 "Qwen3VLForConditionalGeneration", "LlavaForConditionalGeneration")
_TEXT = ("input_ids", "attention_mask") + TOKEN_FIELDS


def has_vision(model: Any) -> bool:
    """Whether ``model`` (or the model it wraps) has a vision tower: a ``vision_config``."""
    return getattr(getattr(unwrap(model), "config", None), "vision_config", None) is not None


def image_refusal(model: Any, collate: Any, samples: Optional[Sequence[Any]], name: str,
                  tol: float) -> Tuple[float, Optional[str]]:
    """Why ``model`` (it has a vision tower) cannot train packed rows with images, or None; and the difference.

    Takes up to two ``samples`` with images and one without, packs them with ``collate``
    and compares each sample's logits in the row with its logits alone (a batch of one,
    as the model's processor made it). Returns (the largest difference, None) when they
    match within ``tol`` times the largest logit; with no sample carrying images,
    (0.0, None) for ``VERIFIED_VLMS``. Otherwise the refusal: the logits differ, the model
    cannot take the row, or there are no samples with images to try and the model is not
    one of ``VERIFIED_VLMS``.

    Example:
        >>> from odb.bench.vlm_data import build_model, vlm_samples
        >>> from odb.packed.collate import PackedCollate
        >>> model = build_model("llava", dtype=torch.float64)
        >>> image_refusal(model, PackedCollate(), vlm_samples("llava", 6), "LLaVA", 1e-6)[1] is None
        True
    """
    label = type(model).__name__
    with_images = [s for s in (samples or ()) if isinstance(s, Mapping) and image_fields([s])]
    if not with_images:
        if label in VERIFIED_VLMS:
            return 0.0, None
        return 0.0, (
            f"odb refuses layout='packed' for {name}: it has a vision tower, and odb has compared packed rows with "
            f"images against each sample alone for {', '.join(VERIFIED_VLMS)} only. Another model's image inputs "
            f"may not keep their meaning when the images of a row's samples are concatenated (a pixel_values "
            f"dimension per sample, image tokens attending both ways, cross-attention to the whole batch). Fix: "
            f"let odb probe it on your samples, odb.check_packed_model(model, collate, samples=[dataset[i] for i in "
            f"range(8)]) (samples with pixel_values), or use layout='padded'.")
    text_only = [s for s in samples or () if isinstance(s, Mapping) and "input_ids" in s and not image_fields([s])]
    probe = with_images[:2] + text_only[:1]
    try:
        diff, scale = _compare(model, collate, probe)
    except Exception as err:  # the model cannot take the row's images at all
        return float("inf"), (
            f"odb refuses layout='packed' for {name}: it fails on a packed row of {len(probe)} of your samples with "
            f"images ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}): its image inputs "
            f"({', '.join(image_fields(probe))}) do not concatenate into one row. Fix: use layout='padded'.")
    if diff > tol * scale:
        return diff, (
            f"odb refuses layout='packed' for {name}: on a packed row of {len(probe)} of your samples with images "
            f"({', '.join(image_fields(probe))}), a sample's logits differ from its logits alone by {diff:.3g} "
            f"(tolerance {tol * scale:.3g}): the model mixes the samples' images or positions in one row. Fix: "
            f"use layout='padded'.")
    return diff, None


def _alone(sample: Mapping, device: torch.device) -> Dict[str, Any]:
    """A sample as a batch of one, as a padded collate gives it: text fields (1, L), image fields as they are."""
    out: Dict[str, Any] = {}
    for key, value in sample.items():
        if value is None or (key not in _TEXT and key not in IMAGE_FIELDS):
            continue
        value = torch.as_tensor(value)
        out[key] = (value.reshape(1, -1) if key in _TEXT else value).to(device)
    return out


def _compare(model: Any, collate: Any, probe: List[Mapping]) -> tuple:
    """(largest |logit difference| of a sample packed vs alone, max(1, largest logit alone))."""
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            row = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in collate(probe).items()
                   if k != "labels"}
            packed = model(**row).logits[0].double()
            alone = [model(**_alone(s, device)).logits[0].double() for s in probe]
    finally:
        model.train(was_training)
    diff, scale, start = 0.0, 1.0, 0
    for ref in alone:
        diff = max(diff, float((packed[start:start + len(ref)] - ref).abs().max()))
        scale = max(scale, float(ref.abs().max()))
        start += len(ref)
    return diff, scale
