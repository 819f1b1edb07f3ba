"""PadToBucket: a collated batch padded on to its shape bucket (``ODBConfig(shape_buckets=...)``).

odb plans each batch at a bucket length (odb.plan.costs.buckets), but the collate_fn pads: a
collator pads to the batch's longest sample (rounded to its ``pad_to_multiple_of``)
and takes no per-batch length. So with ``shape_buckets`` the loader wraps the
collate_fn in ``PadToBucket``, which pads the collated batch's sequence tensors on
to the bucket of their width, the length odb planned and costed.

A dict batch (what transformers' collators return) is padded key by key:
``labels`` with ``ignore_index``, ``input_ids`` / ``decoder_input_ids`` with the
collator's pad token (its ``pad_token_id`` or its tokenizer's; 0 without one), and
every other tensor of shape (B, W, ...) whose W is the width of one of those
(``attention_mask``, ``token_type_ids``, ``position_ids``, masks of any name) with
0. Padding goes on the side the collator's tokenizer pads (right without one). The
pad positions are masked (attention_mask 0) and unsupervised (labels ``ignore_index``),
so a causal LM's loss is unchanged (tests/train/test_compile.py checks it). Other batch types
(tuples, lists, tensors, objects) are returned as the collate made them, with one
warning when their width is not a bucket: such a collate_fn pads to
``odb.bucket_length(width, cfg.shape_buckets)`` itself.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from odb.plan.costs.buckets import bucket_length

_ID_KEYS = ("input_ids", "decoder_input_ids")
_LABEL_KEYS = ("labels",)
_SEQUENCE_KEYS = _ID_KEYS + _LABEL_KEYS + ("attention_mask", "decoder_attention_mask")


class PadToBucket:
    """``collate_fn``, then the batch's sequence tensors padded to their shape bucket. Picklable.

    Args:
        collate_fn: the collate to run first (it pads to the longest sample, as usual).
        buckets: the bucket lengths, increasing (``cfg.shape_buckets``).
        ignore_index: what ``labels`` are padded with.
        pad_token_id: what ``input_ids`` are padded with; None: the collate_fn's ``pad_token_id`` or its
            tokenizer's, else 0.
        pad_values: ``{key: value}`` for other keys, or to override the defaults.
        padding_side: "right", "left", or None: the collate_fn's tokenizer's side, else "right".

    Example:
        >>> import torch
        >>> def collate(samples):  # pads to the longest sample (5 tokens)
        ...     rows = [torch.tensor(s) for s in samples]
        ...     ids = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)
        ...     labels = torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=-100)
        ...     return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long()}
        >>> batch = PadToBucket(collate, (4, 8))([[5, 6, 7], [8, 9, 1, 2, 3]])  # on to the bucket 8
        >>> batch["input_ids"][0].tolist(), batch["labels"][0].tolist(), batch["attention_mask"][1].tolist()
        ([5, 6, 7, 0, 0, 0, 0, 0], [5, 6, 7, -100, -100, -100, -100, -100], [1, 1, 1, 1, 1, 0, 0, 0])
    """

    def __init__(self, collate_fn: Callable[[List[Any]], Any], buckets: Sequence[int], *, ignore_index: int = -100,
                 pad_token_id: Optional[int] = None, pad_values: Optional[Dict[str, Any]] = None,
                 padding_side: Optional[str] = None, multiple: int = 1) -> None:
        if (not buckets and multiple == 1) or list(buckets) != sorted(set(int(b) for b in buckets)):
            raise ValueError(f"PadToBucket got buckets={buckets!r}: they must be increasing lengths. Fix: pass "
                             f"cfg.shape_buckets of an ODBConfig with shape_buckets set.")
        if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1:
            raise ValueError(f"PadToBucket got multiple={multiple!r}: an int >= 1. Fix: pass cfg.length_multiple.")
        # widths are also rounded up to a multiple of this (context parallelism splits every sequence evenly)
        self.multiple = int(multiple)
        if padding_side not in (None, "right", "left"):
            raise ValueError(f"PadToBucket got padding_side={padding_side!r}: it must be 'right', 'left' or None "
                             f"(the collate_fn's tokenizer's). Fix: pass padding_side='right'.")
        self.collate_fn = collate_fn
        self.buckets: Tuple[int, ...] = tuple(int(b) for b in buckets)
        self.ignore_index = int(ignore_index)
        tokenizer = getattr(collate_fn, "tokenizer", None) or getattr(collate_fn, "processing_class", None)
        if pad_token_id is None:
            pad_token_id = getattr(collate_fn, "pad_token_id", None)
        if pad_token_id is None:
            pad_token_id = getattr(tokenizer, "pad_token_id", None)
        self.pad_token_id = int(pad_token_id) if isinstance(pad_token_id, int) else 0
        side = padding_side or getattr(tokenizer, "padding_side", None)
        self.padding_side = side if side in ("right", "left") else "right"
        self.pad_values = dict(pad_values or {})
        self._warned = False

    def __getattr__(self, name: str) -> Any:
        # The wrapped collate's attributes (e.g. a collator's tokenizer) read through, as on the collate itself.
        if name == "collate_fn":
            raise AttributeError(name)
        return getattr(self.collate_fn, name)

    def __getstate__(self) -> Dict[str, Any]:
        return dict(self.__dict__)

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __call__(self, samples: List[Any]) -> Any:
        batch = self.collate_fn(samples)
        if isinstance(batch, Mapping):
            return self._pad_mapping(batch, len(samples))
        self._check_other(batch, len(samples))
        return batch

    def target(self, width: int) -> int:
        """The width a batch of ``width`` is padded to: its bucket (when there are buckets), rounded up to
        ``multiple``."""
        width = bucket_length(width, self.buckets) if self.buckets else width
        return -(-width // self.multiple) * self.multiple

    def pad_value(self, key: str) -> Any:
        """What the tensor under ``key`` is padded with."""
        if key in self.pad_values:
            return self.pad_values[key]
        if key in _LABEL_KEYS:
            return self.ignore_index
        if key in _ID_KEYS:
            return self.pad_token_id
        return 0

    def _pad_mapping(self, batch: Any, rows: int) -> Any:
        def sequence(value: Any) -> bool:
            return isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows

        known = set(_SEQUENCE_KEYS) | set(self.pad_values)
        widths = {int(v.shape[1]) for k, v in batch.items() if k in known and sequence(v)}
        if not widths:
            self._warn(batch, "none of its tensors is a (B, W) input_ids, labels or attention_mask")
            return batch
        for key, value in list(batch.items()):
            if not sequence(value) or int(value.shape[1]) not in widths:
                continue
            width = int(value.shape[1])
            target = self.target(width)
            if target != width:
                batch[key] = self._pad(value, target - width, self.pad_value(key))
        return batch

    def _pad(self, value: torch.Tensor, extra: int, fill: Any) -> torch.Tensor:
        shape = list(value.shape)
        shape[1] = extra
        pad = torch.full(shape, fill, dtype=value.dtype, device=value.device)
        parts = (value, pad) if self.padding_side == "right" else (pad, value)
        return torch.cat(parts, dim=1)

    def _check_other(self, batch: Any, rows: int) -> None:
        items = batch if isinstance(batch, (tuple, list)) else (batch,)
        for value in items:
            if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[0] == rows:
                width = int(value.shape[1])
                if self.target(width) != width:
                    self._warn(batch, f"a (B, W) tensor has W={width}, not a bucket")
                return

    def _warn(self, batch: Any, what: str) -> None:
        if self._warned:
            return
        self._warned = True
        name = getattr(self.collate_fn, "__name__", type(self.collate_fn).__name__)
        warnings.warn(f"odb (shape_buckets): collate_fn={name} returned a {type(batch).__name__} batch that odb "
                      f"cannot pad to its shape bucket ({what}), so the model sees the collate's own widths and "
                      f"shape_buckets bounds nothing. Fix: return a dict with input_ids / labels / attention_mask, "
                      f"or pad in the collate_fn to odb.bucket_length(width, cfg.shape_buckets) "
                      f"(buckets {self.buckets}).", UserWarning, stacklevel=2)
