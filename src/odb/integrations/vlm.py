"""Image-less micro-batches of a vision-language model under several processes: a dummy image, never a hang.

Under DDP with ``find_unused_parameters=False`` (the Trainer's choice with gradient
checkpointing) and under FSDP or DeepSpeed, every rank must run the same modules in
every micro-batch (DDP with ``find_unused_parameters=True`` tolerates a skipped module): a rank whose micro-batch holds no image skips the vision tower, and
the ranks' gradient all-reduces (DDP) or parameter all-gathers (FSDP) fall out of step,
a silent hang. ``VisionDummyCollate`` wraps the collator: a batch without images gets
one dummy image (zeros) whose placeholder tokens sit in padding slots (``attention_mask``
0, label -100; a column is added when the batch has none free), so the vision tower
runs on every rank and adds exactly zero to the loss and the gradient: no real token
attends to a padding slot, and a slot's own output is not supervised (docs/vlm.md).

Known models (``dummy_image_for``): the Qwen-VL family (``qwen2_vl``, ``qwen2_5_vl``,
``qwen3_vl``, ``qwen3_vl_moe``: one merged patch, one placeholder token) and LLaVA
(``llava``: one image of the tower's size). For another vision-language model an
image-less batch raises, naming the fix, instead of hanging.

Example:
    >>> from odb.integrations.vlm import DummyImage, VisionDummyCollate
    >>> import torch
    >>> dummy = DummyImage("qwen2_vl", image_token_id=9, tokens=1, pixel_shape=(4, 12), grid=(1, 2, 2))
    >>> collate = VisionDummyCollate(lambda s: {"input_ids": torch.tensor([[5, 6, 0]]),
    ...                                          "attention_mask": torch.tensor([[1, 1, 0]]),
    ...                                          "labels": torch.tensor([[5, 6, -100]])}, dummy)
    >>> batch = collate([None])
    >>> batch["input_ids"].tolist(), batch["mm_token_type_ids"].tolist(), batch["image_grid_thw"].tolist()
    ([[5, 6, 9]], [[0, 0, 1]], [[1, 2, 2]])
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Dict, Optional, Tuple

import torch

__all__ = ["DummyImage", "VisionDummyCollate", "dummy_image_for", "has_images", "imageless_guard", "is_vision_language"]

IGNORE_INDEX = -100
QWEN_VL = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")  # pixel patches + image_grid_thw + mm_token_type_ids
LLAVA = ("llava",)  # one fixed-size image per placeholder run


@dataclasses.dataclass(frozen=True)
class DummyImage:
    """One dummy image of a model family: its placeholder tokens and tensors.

    Attributes:
        family: the model's ``config.model_type``.
        image_token_id: the placeholder token the model replaces by image features.
        tokens: placeholder tokens of one dummy image (the features the vision path returns for it).
        pixel_shape: shape of its ``pixel_values`` (patches x features for Qwen-VL, 1 x C x H x W for LLaVA).
        grid: its ``image_grid_thw`` row (Qwen-VL), else None.
    """

    family: str
    image_token_id: int
    tokens: int
    pixel_shape: Tuple[int, ...]
    grid: Optional[Tuple[int, int, int]] = None


def _config(model: Any) -> Any:
    return getattr(getattr(model, "module", model), "config", None)


def is_vision_language(model: Any) -> bool:
    """Whether ``model`` (or the model a wrapper holds) has a vision tower: its config has a ``vision_config``.

    Example:
        >>> is_vision_language(torch.nn.Linear(2, 2))
        False
    """
    return getattr(_config(model), "vision_config", None) is not None


def dummy_image_for(model: Any) -> Optional[DummyImage]:
    """The dummy image of a known vision-language model (see the module docstring); None for others.

    Example:
        >>> dummy_image_for(torch.nn.Linear(2, 2)) is None
        True
    """
    cfg = _config(model)
    kind = getattr(cfg, "model_type", None)
    vision = getattr(cfg, "vision_config", None)
    token = getattr(cfg, "image_token_id", None)
    if vision is None or token is None:
        return None
    if kind in QWEN_VL:
        merge = int(vision.spatial_merge_size)
        channels = int(getattr(vision, "in_channels", getattr(vision, "in_chans", 3)))
        width = channels * int(vision.temporal_patch_size) * int(vision.patch_size) ** 2
        return DummyImage(kind, int(token), 1, (merge * merge, width), (1, merge, merge))
    if kind in LLAVA and isinstance(getattr(cfg, "vision_feature_layer", None), int):
        size, patch = int(vision.image_size), int(vision.patch_size)
        tokens = (size // patch) ** 2 + (1 if cfg.vision_feature_select_strategy == "full" else 0)
        return DummyImage(kind, int(token), tokens, (1, int(getattr(vision, "num_channels", 3)), size, size))
    return None


def has_images(batch: Any) -> bool:
    """Whether a collated batch carries image pixels (a non-empty ``pixel_values``).

    Example:
        >>> has_images({"input_ids": torch.ones(1, 3)}), has_images({"pixel_values": torch.ones(4, 12)})
        (False, True)
    """
    pixels = batch.get("pixel_values") if isinstance(batch, Mapping) else None
    return pixels is not None and (not isinstance(pixels, torch.Tensor) or pixels.numel() > 0)


class VisionDummyCollate:
    """Wraps a collator: a batch without images gets one dummy image (see the module docstring).

    ``dummy=None`` (a model odb has no dummy for) raises at an image-less batch instead, with
    the fix ``fix`` (odb's exchange then stops every rank before that step). Picklable when
    the wrapped collator is: it runs in the loader's workers.

    Example:
        >>> VisionDummyCollate(lambda s: {"input_ids": torch.ones(1, 2)}, None, model="Foo", fix="use DDP")([1])
        Traceback (most recent call last):
        ...
        ValueError: a micro-batch of Foo holds no image, ... Fix: use DDP.
    """

    def __init__(self, collate: Callable[[Any], Any], dummy: Optional[DummyImage], *, model: str = "",
                 fix: str = "") -> None:
        self.collate, self.dummy, self.model, self.fix = collate, dummy, model, fix

    def __call__(self, samples: Any) -> Any:
        batch = self.collate(samples)
        if has_images(batch):
            return batch
        if self.dummy is None:
            raise ValueError(
                f"a micro-batch of {self.model} holds no image, so this rank would skip the vision tower while other "
                f"ranks run it, and their collectives would wait on each other forever (a silent hang). Rule: under "
                f"several processes every rank must run the same modules in every micro-batch; odb adds a dummy image "
                f"to an image-less micro-batch only for the models it knows (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, LLaVA). "
                f"Fix: {self.fix}.")
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError(f"odb's dummy image needs a batch dict with input_ids; the collator returned "
                             f"{type(batch).__name__}. Fix: return a dict of tensors (input_ids, attention_mask, "
                             f"labels, pixel_values, ...).")
        return add_dummy_image(dict(batch), self.dummy)

    def __repr__(self) -> str:
        return f"VisionDummyCollate({self.collate!r}, {self.dummy!r})"


def add_dummy_image(batch: Dict[str, Any], dummy: DummyImage) -> Dict[str, Any]:
    """``batch`` with one dummy image whose placeholder tokens fill free padding slots (added columns if needed).

    A free slot has ``attention_mask`` 0 and label -100. Per-token tensors (shape of
    ``input_ids``) grow with the added columns (0; labels -100; attention_mask 0).

    Example:
        >>> d = DummyImage("llava", image_token_id=7, tokens=2, pixel_shape=(1, 3, 4, 4))
        >>> out = add_dummy_image({"input_ids": torch.tensor([[4, 5], [6, 0]]),
        ...                        "attention_mask": torch.tensor([[1, 1], [1, 0]])}, d)
        >>> out["input_ids"].tolist(), out["attention_mask"].tolist(), tuple(out["pixel_values"].shape)
        ([[4, 5, 7], [6, 7, 0]], [[1, 1, 0], [1, 0, 0]], (1, 3, 4, 4))
    """
    ids = batch["input_ids"]
    if "attention_mask" not in batch and ("position_ids" in batch or "cu_seq_lens_q" in batch):
        raise ValueError("odb's dummy image for an image-less micro-batch needs padding slots, and this batch is a "
                         "packed row (position_ids or cu_seq_lens, no attention_mask). Rule: under several "
                         "processes every rank must run the vision tower in every micro-batch. Fix: layout='padded' "
                         "for a vision-language model under FSDP, DeepSpeed or DDP with find_unused_parameters=False, "
                         "or DDP with find_unused_parameters=True.")
    if ids.ndim != 2:
        raise ValueError(f"odb's dummy image needs input_ids of shape (rows, width); got {tuple(ids.shape)}. Fix: "
                         f"collate padded rows (odb's layout='padded').")
    rows, width = ids.shape
    shape = (rows, width)
    mask = batch.get("attention_mask")
    labels = batch.get("labels")
    free = torch.zeros(shape, dtype=torch.bool) if mask is None else (mask == 0).cpu()
    if isinstance(labels, torch.Tensor) and tuple(labels.shape) == shape:
        free &= (labels == IGNORE_INDEX).cpu()
    short = dummy.tokens - int(free.sum())
    added = 0 if short <= 0 else -(-short // rows)
    fill = {"labels": IGNORE_INDEX}
    if mask is None:
        batch["attention_mask"] = torch.ones(shape, dtype=torch.long, device=ids.device)
    for key, value in list(batch.items()):
        if isinstance(value, torch.Tensor) and tuple(value.shape) == shape and added:
            pad = torch.full((rows, added), fill.get(key, 0), dtype=value.dtype, device=value.device)
            batch[key] = torch.cat([value, pad], dim=1)
    if added:
        free = torch.cat([free, torch.ones(rows, added, dtype=torch.bool)], dim=1)
    slots = free.reshape(-1).nonzero().reshape(-1)[:dummy.tokens]
    ids = batch["input_ids"].clone()
    ids.view(-1)[slots.to(ids.device)] = dummy.image_token_id
    batch["input_ids"] = ids
    pixels = torch.zeros(dummy.pixel_shape, dtype=torch.float32, device=ids.device)
    batch["pixel_values"] = pixels
    if dummy.grid is not None:
        batch["image_grid_thw"] = torch.tensor([dummy.grid], dtype=torch.long, device=ids.device)
        types = batch.get("mm_token_type_ids")
        types = torch.zeros_like(ids, dtype=torch.long) if types is None else types.clone()
        types.view(-1)[slots.to(types.device)] = 1
        batch["mm_token_type_ids"] = types
    return batch


def imageless_guard(collate: Callable[[Any], Any], model: Any, *, world_size: int,
                    ddp_finds_unused: bool) -> Callable[[Any], Any]:
    """``collate`` wrapped in ``VisionDummyCollate`` where an image-less micro-batch could hang the ranks.

    Unchanged for one process, a model without a vision tower, or plain DDP that finds unused
    parameters (``ddp_finds_unused``: it tolerates a rank that skips a module). Otherwise (DDP
    with ``find_unused_parameters=False``, FSDP, DeepSpeed) a known model gets the dummy and
    another vision-language model the error at its first image-less batch.

    Example:
        >>> imageless_guard(list, torch.nn.Linear(2, 2), world_size=2, ddp_finds_unused=False) is list
        True
    """
    if world_size <= 1 or ddp_finds_unused or not is_vision_language(model):
        return collate
    dummy = dummy_image_for(model)
    name = type(getattr(model, "module", model)).__name__
    fix = ("under DDP, set TrainingArguments(ddp_find_unused_parameters=True) (non-reentrant gradient checkpointing, "
           "the default, allows it); under FSDP or DeepSpeed, give every sample an image, or collate a dummy image of "
           "your model into image-less batches (docs/vlm.md)")
    return VisionDummyCollate(collate, dummy, model=name, fix=fix)
