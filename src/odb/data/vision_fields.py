"""The image fields of a vision-language sample, by name, and the check that a collate keeps them.

A VLM sample, as its processor makes it (one sample processed alone), holds the text
(``input_ids`` with each image's placeholder tokens expanded, ``labels``,
``attention_mask``), fields aligned with the tokens (``mm_token_type_ids`` of the Qwen-VL
family, ``token_type_ids``) and per-image tensors whose first dimension counts images,
patches or frames (``pixel_values``, ``image_grid_thw``, ``image_sizes``, the video
equivalents). A batch keeps its samples' images by concatenating each per-image field
along that first dimension, in sample order: the model then scatters the image features
into the placeholder tokens in the same order.

A collate that drops them (returns no ``pixel_values`` for samples that have some)
trains the placeholder tokens as text and the vision tower not at all, without an
error from the model: ``dropped_image_fields`` finds it.

Example:
    >>> import torch
    >>> samples = [{"input_ids": [1, 2], "pixel_values": torch.ones(4, 6)}, {"input_ids": [3]}]
    >>> image_fields(samples)
    ('pixel_values',)
    >>> dropped_image_fields(samples, {"input_ids": torch.ones(2, 2)})
    ('pixel_values',)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Sequence, Tuple

# Per-image (or per-frame) tensors: concatenated along dim 0 in sample order.
IMAGE_FIELDS = ("pixel_values", "image_grid_thw", "image_sizes", "pixel_values_videos", "video_grid_thw",
                "second_per_grid_ts", "pixel_attention_mask")
# Tensors with one entry per token of input_ids: concatenated along the tokens.
TOKEN_FIELDS = ("mm_token_type_ids", "token_type_ids")


def image_patches(fields: Any, patches_per_image: int = 1) -> int:
    """Image patches a sample or batch (a mapping) makes its vision tower run on: the patches of its
    ``image_grid_thw`` rows (the Qwen-VL family), else its ``pixel_values`` images (one fixed-size image
    per row, LLaVA-style) times ``patches_per_image``; 0 without images.

    Example:
        >>> import torch
        >>> image_patches({"image_grid_thw": torch.tensor([[1, 4, 6], [1, 2, 2]])})
        28
        >>> image_patches({"pixel_values": torch.ones(2, 3, 8, 8)}, patches_per_image=4), image_patches({})
        (8, 0)
    """
    grid = fields.get("image_grid_thw") if isinstance(fields, Mapping) else None
    if grid is not None:
        return int(grid.prod(-1).sum())
    pixels = fields.get("pixel_values") if isinstance(fields, Mapping) else None
    if pixels is not None and pixels.numel():
        return int(pixels.shape[0]) * int(patches_per_image)
    return 0


def image_fields(samples: Sequence[Any]) -> Tuple[str, ...]:
    """The ``IMAGE_FIELDS`` that at least one of ``samples`` (mappings) holds, not None, in that order."""
    present = {k for s in samples if isinstance(s, Mapping) for k in IMAGE_FIELDS if s.get(k) is not None}
    return tuple(k for k in IMAGE_FIELDS if k in present)


def dropped_image_fields(samples: Sequence[Any], batch: Any) -> Tuple[str, ...]:
    """The image fields ``samples`` hold that the collated ``batch`` (a mapping) lacks; () for other batches.

    A batch that is not a mapping (a tuple, a tensor, a list of samples) is not judged.
    """
    if not isinstance(batch, Mapping):
        return ()
    return tuple(k for k in image_fields(samples) if batch.get(k) is None)
