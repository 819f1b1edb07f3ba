"""TRL's vision-language SFT path under odb: each sample processed alone, then padded batches.

TRL's ``SFTTrainer`` trains a vision-language model when its ``processing_class`` is a
processor and the dataset has ``image`` / ``images``: it skips dataset preparation and its
``DataCollatorForVisionLanguageModeling`` applies the chat template, expands the image tokens
and processes the images inside the collator, so a sample's length exists only once the
collator has run. odb needs it before batching, so under ``enable_odb`` the training loader
reads ``ProcessedSamples``: TRL's own collator applied to each sample alone (in the
loader's workers; each sample is processed once, as without odb), its padding removed, and
``image_patches`` added (the vision tower's patches: pass ``image_patches_key="image_patches"``
with ``max_image_patches`` to cap them). ``PadVisionCollate`` then pads the text fields as TRL
pads them (right, ``labels`` -100) and concatenates the image fields in sample order: the
batch TRL's collator would have built from the same samples, without the padding odb avoids.

Example:
    >>> import torch
    >>> pad = PadVisionCollate(pad_token_id=0)
    >>> batch = pad([{"input_ids": torch.tensor([5, 6]), "labels": torch.tensor([-100, 6]), "image_patches": 0},
    ...              {"input_ids": torch.tensor([7]), "labels": torch.tensor([7]), "image_patches": 0}])
    >>> batch["input_ids"].tolist(), batch["labels"].tolist(), sorted(batch)
    ([[5, 6], [7, 0]], [[-100, 6], [7, -100]], ['input_ids', 'labels'])
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from odb.data.vision_fields import image_patches as count_patches

__all__ = ["PATCHES_KEY", "PadVisionCollate", "ProcessedSamples", "trl_vision_collator", "vision_samples"]

PATCHES_KEY = "image_patches"
IGNORE_INDEX = -100
_SFT_MODULE = "trl.trainer.sft_trainer"
# Per-token fields of TRL's collator output (shape 1 x width for one sample); the others are image fields.
TOKEN_FIELDS = {"input_ids": None, "attention_mask": 0, "labels": IGNORE_INDEX, "mm_token_type_ids": 0,
                "token_type_ids": 0, "completion_mask": 0, "assistant_masks": 0}


def trl_vision_collator(collator: Any) -> bool:
    """Whether ``collator`` is TRL's ``DataCollatorForVisionLanguageModeling`` (False when TRL is not imported).

    Example:
        >>> trl_vision_collator(list)
        False
    """
    sft = sys.modules.get(_SFT_MODULE)
    vision = getattr(sft, "DataCollatorForVisionLanguageModeling", None)
    return vision is not None and isinstance(collator, vision)


def image_patches(sample: Dict[str, Any]) -> int:
    """Vision cost of one processed sample: the patches of ``image_grid_thw`` (Qwen-VL), else the images of
    ``pixel_values`` (LLaVA-style: one fixed-size image per row; multiply the cap by its patches per image).

    Example:
        >>> image_patches({"image_grid_thw": torch.tensor([[1, 4, 6], [1, 2, 2]])})
        28
    """
    return count_patches(sample)


class ProcessedSamples(torch.utils.data.Dataset):
    """A dataset whose items are TRL's collator output for each raw sample alone, without padding.

    Per-token fields (``TOKEN_FIELDS``) become 1-D tensors cut to the sample's
    ``attention_mask`` (TRL pads on the right); image fields stay as the collator returned
    them; ``image_patches`` holds ``image_patches(sample)``.
    """

    def __init__(self, dataset: Any, collator: Any) -> None:
        self.dataset, self.collator = dataset, collator

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Dict[str, Any]:
        raw = dict(self.dataset[index])  # TRL's collator pops "image" from the samples it gets
        batch = self.collator([raw])
        width = int(batch["attention_mask"].sum()) if "attention_mask" in batch else batch["input_ids"].shape[1]
        out: Dict[str, Any] = {}
        for key, value in batch.items():
            if key in TOKEN_FIELDS and isinstance(value, torch.Tensor) and value.ndim == 2:
                out[key] = value[0, :width]
            elif value is not None:
                out[key] = value
        out[PATCHES_KEY] = image_patches(out)
        return out


class PadVisionCollate:
    """Pads processed vision-language samples as TRL's collator does (right; ``labels`` -100, masks 0,
    ``input_ids`` with ``pad_token_id``; width a multiple of ``pad_to_multiple_of``) and concatenates their
    image fields (``pixel_values``, ``image_grid_thw``...) in sample order; ``image_patches`` is dropped."""

    def __init__(self, pad_token_id: int, pad_to_multiple_of: Optional[int] = None) -> None:
        self.pad_token_id, self.pad_to_multiple_of = int(pad_token_id), pad_to_multiple_of

    def __call__(self, samples: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
        width = max(len(s["input_ids"]) for s in samples)
        if self.pad_to_multiple_of:
            width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        batch: Dict[str, Any] = {}
        for key in samples[0]:
            if key == PATCHES_KEY:
                continue
            if key in TOKEN_FIELDS:
                fill = self.pad_token_id if TOKEN_FIELDS[key] is None else TOKEN_FIELDS[key]
                rows = torch.full((len(samples), width), fill, dtype=samples[0][key].dtype)
                for i, s in enumerate(samples):
                    rows[i, :len(s[key])] = s[key]
                batch[key] = rows
        images = {k for s in samples for k in s if k not in TOKEN_FIELDS and k != PATCHES_KEY}
        for key in sorted(images):
            parts = [s[key] for s in samples if isinstance(s.get(key), torch.Tensor)]
            if parts:
                batch[key] = torch.cat(parts)
        return batch

    def __repr__(self) -> str:
        return f"PadVisionCollate(pad_token_id={self.pad_token_id}, pad_to_multiple_of={self.pad_to_multiple_of})"


def vision_samples(dataset: Any, collator: Any) -> Tuple[Any, Any, bool]:
    """``(dataset, collator, swapped)``: for TRL's vision collator, ``ProcessedSamples`` and ``PadVisionCollate``;
    otherwise the two unchanged.

    Example:
        >>> vision_samples([1, 2], list)[2]
        False
    """
    if not trl_vision_collator(collator):
        return dataset, collator, False
    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError(f"odb cannot batch TRL's vision-language collator over an iterable dataset "
                         f"({type(dataset).__name__}): odb processes each sample alone to measure it, which it does "
                         f"for map-style datasets. Fix: pass a map-style dataset (datasets.Dataset, a list), or "
                         f"process the samples yourself into input_ids, labels and image fields (docs/vlm.md).")
    pad = collator.processor.tokenizer.pad_token_id
    return ProcessedSamples(dataset, collator), PadVisionCollate(pad, collator.pad_to_multiple_of), True
