"""Splitting a collated batch into row pieces (for the OOM fallback), trimming padding per piece."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, Sequence, Tuple

import torch


class BatchSplitter(Protocol):
    """How to cut a batch into row subsets and weigh each (the loss is a mean over the weight)."""

    def rows(self, batch: Any) -> int: ...

    def take(self, batch: Any, rows: Sequence[int]) -> Any: ...

    def weight(self, piece: Any) -> float: ...


@dataclasses.dataclass(frozen=True)
class PaddedBatchSplitter:
    """Default splitter for dict batches of row-first padded tensors (input_ids, attention_mask, labels, ...).

    ``take`` selects rows of every tensor (and list) whose first dimension is the batch
    size, then trims the padding: tensors whose second dimension matches a mask in
    ``mask_keys`` are cut to the longest selected row of that mask. ``weight`` counts
    labels != ignore_index (``labels[:, 1:]`` with shift_labels, as HF causal LMs
    shift inside the model), or rows when the batch has no labels.

    Example:
        >>> b = {"input_ids": torch.tensor([[1, 2, 0], [3, 0, 0]]), "attention_mask": torch.tensor([[1, 1, 0], [1, 0, 0]]),
        ...      "labels": torch.tensor([[1, 2, -100], [3, -100, -100]])}
        >>> s = PaddedBatchSplitter()
        >>> piece = s.take(b, [1])
        >>> piece["input_ids"].tolist(), s.weight(piece), s.weight(b)
        ([[3]], 1, 3)
    """

    label_key: str = "labels"
    ignore_index: int = -100
    shift_labels: bool = False
    mask_keys: Tuple[str, ...] = ("attention_mask", "decoder_attention_mask")

    def rows(self, batch: Any) -> int:
        for value in self._mapping(batch).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                return int(value.shape[0])
        raise TypeError(f"the batch has no tensor to count rows from (keys {list(batch)}). Fix: pass splitter= "
                        f"an object with rows/take/weight for this batch type.")

    def take(self, batch: Any, rows: Sequence[int]) -> Any:
        n, rows = self.rows(batch), list(rows)
        widths = {}  # padded width -> longest selected row, from the masks
        for key in self.mask_keys:
            mask = batch.get(key)
            if isinstance(mask, torch.Tensor) and mask.dim() == 2 and mask.shape[0] == n:
                cols = (mask[torch.as_tensor(rows, device=mask.device)] != 0).any(0).nonzero()
                widths.setdefault(int(mask.shape[1]), int(cols.max()) + 1 if len(cols) else 1)
        out = {}
        for key, value in batch.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == n:
                value = value.index_select(0, torch.as_tensor(rows, device=value.device))
                if value.dim() > 1 and int(value.shape[1]) in widths:
                    value = value[:, :widths[int(value.shape[1])]]
            elif isinstance(value, (list, tuple)) and len(value) == n:
                value = type(value)(value[i] for i in rows)
            out[key] = value
        return out if type(batch) is dict else type(batch)(out)

    def weight(self, piece: Any) -> float:
        labels = self._mapping(piece).get(self.label_key)
        if not isinstance(labels, torch.Tensor):
            return self.rows(piece)
        if self.shift_labels:
            labels = labels[..., 1:]
        return int((labels != self.ignore_index).sum())

    @staticmethod
    def _mapping(batch: Any) -> Mapping:
        if not isinstance(batch, Mapping):
            raise TypeError(f"PaddedBatchSplitter handles dict batches; got {type(batch).__name__}. Fix: pass "
                            f"splitter= an object with rows(batch), take(batch, rows) and weight(piece).")
        return batch
