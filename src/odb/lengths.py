"""What odb reads from one processed sample: its length(s), loss tokens, image patches."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any, Sequence, Tuple, Union

import torch

_SEQUENCE_KEYS = ("input_ids", "input_values", "input_features", "pixel_values")


def _size(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return int(value.shape[-1]) if value.dim() == 1 else int(value.shape[0])
    if hasattr(value, "shape") and len(value.shape) > 0:
        return int(value.shape[0])
    return len(value)


def default_length(sample: Any) -> int:
    """Length of a processed sample: ``input_ids`` of a dict, else the sample or its first field.

    Example:
        >>> default_length({"input_ids": [1, 2, 3], "labels": [1, 2, 3]})
        3
    """
    try:
        if isinstance(sample, Mapping):
            for key in _SEQUENCE_KEYS:
                if key in sample:
                    return _size(sample[key])
            raise TypeError(f"no field among {_SEQUENCE_KEYS}; fields are {list(sample)}")
        if isinstance(sample, tuple) and sample and not isinstance(sample[0], (int, float)):
            return _size(sample[0])
        return _size(sample)
    except TypeError as err:
        raise TypeError(
            f"odb cannot tell the length of a sample of type {type(sample).__name__} ({err}). "
            f"Rule: the default length_fn reads input_ids of a dict, a tensor/sequence, or the first field "
            f"of a tuple. Fix: pass length_fn=lambda sample: <number of tokens>.") from None


def seq2seq_lengths(sample: Mapping) -> Tuple[int, int]:
    """(source, target) lengths of an encoder-decoder sample with ``input_ids`` and ``labels``.

    Example:
        >>> seq2seq_lengths({"input_ids": [1, 2, 3], "labels": [4, 5]})
        (3, 2)
    """
    return _size(sample["input_ids"]), _size(sample["labels"])


def as_length_tuple(value: Union[int, Sequence[int]], index: int) -> Tuple[int, ...]:
    """Validate what a length_fn returned."""
    out: Tuple[int, ...] = ()
    if not isinstance(value, (str, bytes)):  # iterating "12" would read two lengths
        try:
            out = (operator.index(value),)  # ints, numpy ints, 0-d integer tensors
        except TypeError:
            try:
                out = tuple(int(v) for v in value)
            except (TypeError, ValueError):  # None, floats, other non-sequences fall to the error below
                out = ()
    if not out or any(v < 0 for v in out):
        raise ValueError(f"length_fn returned {value!r} for sample {index}: a length must be an int >= 0 or a "
                         f"tuple of them. Fix: make length_fn return the token count(s) of the sample.")
    return out


def count_loss_tokens(sample: Any, label_key: str = "labels", ignore_index: int = -100, shift: bool = False,
                      fallback: int = 0) -> int:
    """Supervised tokens of a sample: labels != ignore_index (labels[1:] with shift); else ``fallback``.

    Example:
        >>> count_loss_tokens({"labels": [-100, 5, 6]})
        2
    """
    labels = sample.get(label_key) if isinstance(sample, Mapping) else None
    if labels is None:
        return fallback
    if isinstance(labels, torch.Tensor):
        labels = labels.reshape(-1)
        if shift:
            labels = labels[1:]
        return int((labels != ignore_index).sum())
    seq = list(labels)[1:] if shift else labels
    return sum(1 for v in seq if v != ignore_index)


def image_patches(sample: Any, key: str) -> int:
    """Image patches of a sample from the field ``key`` (an int or a tensor/sequence of counts)."""
    value = sample[key] if isinstance(sample, Mapping) else getattr(sample, key)
    if isinstance(value, torch.Tensor):
        return int(value.sum())
    if isinstance(value, (list, tuple)):
        return int(sum(value))
    return int(value)
