"""The group collate, with a clear error when it cannot batch samples of different lengths.

odb's batches mix lengths (that is the point of a token budget), so a collate that only
stacks equal sizes (torch's ``default_collate``, used when no ``collate_fn`` is given,
or transformers' ``default_data_collator``) fails on the first batch with torch's
"stack expects each tensor to be equal size". ``PaddingHint`` re-raises such a failure
as ``RaggedBatchError``, which says that variable-length batches need a padding
collator and names some.

A collate that returns a batch without the images its samples carry (no
``pixel_values`` for samples that have some: a text collator, or one that keeps listed
fields only) trains the image placeholder tokens as text and the vision tower not at
all, and the model raises nothing. ``PaddingHint`` refuses such a batch with
``DroppedImagesError``.

A batch of empty samples only (a blank line in a corpus, an answer truncated away: legal samples
of 0 tokens) collates to a width of 0, on which most models fail; ``PaddingHint`` widens such a
dict batch to one unsupervised position (``widen_empty``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, List, Optional

import torch

from odb.data.lengths import SampleLengthError, default_length
from odb.data.vision_fields import dropped_image_fields

# What torch and transformers say when asked to stack sequences of different lengths.
_SIZE_ERRORS = ("equal size", "expected sequence of length", "Unable to create tensor")


class RaggedBatchError(ValueError):
    """The collate_fn cannot batch samples of different lengths: it needs to pad."""


class DroppedImagesError(ValueError):
    """The collate_fn returned a batch without the image fields its samples carry."""


class PaddingHint:
    """``collate_fn`` as it is, except that its failure on samples of different lengths names the fix,
    and a batch (a mapping) that lacks image fields its samples carry is refused (``DroppedImagesError``).

    Picklable (it runs in the workers when lengths are known up front).

    Example:
        >>> import torch
        >>> from torch.utils.data import default_collate
        >>> collate = PaddingHint(default_collate)
        >>> collate([{"input_ids": torch.ones(3)}, {"input_ids": torch.ones(5)}])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        odb.data.collate_check.RaggedBatchError: odb's batch holds samples of 3 to 5 tokens, ...
    """

    def __init__(self, collate_fn: Callable[[List[Any]], Any], ignore_index: int = -100) -> None:
        self.collate_fn, self.ignore_index = collate_fn, ignore_index

    @property
    def name(self) -> str:
        """The wrapped collate's name, for messages."""
        return getattr(self.collate_fn, "__name__", type(self.collate_fn).__name__)

    def __call__(self, samples: List[Any]) -> Any:
        try:
            batch = self.collate_fn(samples)
        except (RuntimeError, ValueError, TypeError) as err:
            if isinstance(err, RaggedBatchError) or not any(text in str(err) for text in _SIZE_ERRORS):
                raise
            lengths = _lengths(samples)
            if lengths is None or min(lengths) == max(lengths):
                raise
            raise RaggedBatchError(
                f"odb's batch holds samples of {min(lengths)} to {max(lengths)} tokens, and collate_fn={self.name} "
                f"failed to stack them ({type(err).__name__}: {str(err).splitlines()[0]}). Rule: token-budget "
                f"batches mix lengths, so the collate_fn must pad (torch's default_collate and transformers' "
                f"default_data_collator only stack equal sizes). Fix: pass a padding collator, e.g. "
                f"collate_fn=transformers.DataCollatorForSeq2Seq(tokenizer) (pads input_ids and labels; also for "
                f"causal LMs), DataCollatorWithPadding(tokenizer) (no labels), or a function using "
                f"torch.nn.utils.rnn.pad_sequence.") from err
        if isinstance(batch, Mapping):
            batch = widen_empty(batch, len(samples), self.ignore_index)
        dropped = dropped_image_fields(samples, batch)
        if dropped:
            raise DroppedImagesError(
                f"collate_fn={self.name} returned a batch without {', '.join(dropped)}, which "
                f"{sum(1 for s in samples if any(_has(s, k) for k in dropped))} of its {len(samples)} samples carry "
                f"(batch fields: {sorted(map(str, batch))[:12]}). Rule: a vision-language batch keeps its samples' "
                f"images, each image field concatenated in sample order; without them the model trains the image "
                f"placeholder tokens as text and its vision tower not at all, and raises nothing. Fix: collate the "
                f"image fields too (torch.cat of the samples' {dropped[0]}), use odb.PackedCollate.for_model(model) "
                f"for packed rows, or remove the images from the samples if the model is text only.")
        return batch


def widen_empty(batch: Any, rows: int, ignore_index: int = -100) -> Any:
    """A dict batch of empty samples only (its ``input_ids`` of width 0) with every (B, 0, ...) tensor widened
    to one position: ``labels`` ``ignore_index``, ``attention_mask`` 1 (a row that attends to nothing gives NaN
    in attention), everything else 0. Most models fail on a zero-length input; this one runs, supervises
    nothing, and odb scales its loss to an exact zero. Any other batch is returned as it is.

    Example:
        >>> import torch
        >>> batch = widen_empty({"input_ids": torch.zeros(2, 0, dtype=torch.long), "labels": torch.zeros(2, 0)}, 2)
        >>> batch["input_ids"].tolist(), batch["labels"].tolist()
        ([[0], [0]], [[-100.0], [-100.0]])
    """
    ids = batch.get("input_ids")
    if not (isinstance(ids, torch.Tensor) and ids.dim() >= 2 and ids.shape[1] == 0):
        return batch
    fills = {"labels": ignore_index, "attention_mask": 1, "decoder_attention_mask": 1}
    for key, value in list(batch.items()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows and value.shape[1] == 0:
            shape = (value.shape[0], 1) + tuple(value.shape[2:])
            batch[key] = torch.full(shape, fills.get(key, 0), dtype=value.dtype, device=value.device)
    return batch


def _has(sample: Any, key: str) -> bool:
    return isinstance(sample, Mapping) and sample.get(key) is not None


def _lengths(samples: List[Any]) -> Optional[List[int]]:
    try:
        return [default_length(s) for s in samples] if samples else None
    except SampleLengthError:
        return None
