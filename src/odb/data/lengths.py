"""What odb reads from one processed sample: its length(s), loss tokens, image patches."""

from __future__ import annotations

import operator
import warnings
from collections.abc import Mapping
from typing import Any, Iterator, List, Optional, Sequence, Tuple, Union

import torch

_FIX = "Fix: tokenize in the dataset, or pass length_fn=lambda sample: <number of tokens>."
# Fields whose first axis is not the sequence (image channels, mel bins or frames): odb cannot tell their length.
_FEATURE_KEYS = {
    "pixel_values": ("its axes are image channels and pixels",
                     "the number of image patches ((height // patch) * (width // patch))"),
    "input_features": ("its axes are mel bins and frames (Whisper: (80, 3000); Speech2Text: (frames, 80))",
                       "the number of frames (sample['input_features'].shape[-1] for Whisper)"),
}


class SampleLengthError(TypeError):
    """odb cannot read the length of a sample (raw text, several rows, an image or audio features)."""


def _is_text(value: Any) -> bool:
    return isinstance(value, (str, bytes))


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def sequence_length(value: Any, what: str = "the sample") -> int:
    """Tokens of one sequence: a 1-D tensor/array/list, or a single row of shape (1, L).

    Raw text, scalars and several rows are refused (``SampleLengthError``), naming ``what``.

    Example:
        >>> import torch
        >>> sequence_length(torch.ones(1, 7)), sequence_length([[1, 2, 3]]), sequence_length([4, 5])
        (7, 3, 2)
    """
    if _is_text(value) or (isinstance(value, (list, tuple)) and value and _is_text(value[0])):
        raise SampleLengthError(
            f"{what} is raw text ({_preview(value)}): odb would count characters or words, not tokens, and "
            f"strings cannot be padded into tensors. Rule: odb batches processed samples, measured in tokens. {_FIX}")
    shape = getattr(value, "shape", None)
    if shape is not None:
        shape = tuple(int(d) for d in shape)
        if len(shape) == 1:
            return shape[0]
        if len(shape) == 2 and shape[0] == 1:
            return shape[1]  # one row, e.g. tokenizer(text, return_tensors="pt")["input_ids"]
        rule = "a scalar has no length" if not shape else f"it holds {shape[0]} rows"
        raise SampleLengthError(
            f"{what} has shape {shape}: {rule}, and a sample must be one sequence (shape (L,) or (1, L)). "
            f"Fix: return one sequence per dataset item (drop return_tensors='pt' or take [0]), or pass "
            f"length_fn=lambda sample: <number of tokens>.")
    if isinstance(value, (list, tuple)) and value and (isinstance(value[0], (list, tuple))
                                                       or getattr(value[0], "ndim", 0) > 0):
        if len(value) == 1:
            return sequence_length(value[0], what)
        raise SampleLengthError(
            f"{what} is a list of {len(value)} sequences: a sample must be one sequence. Fix: return one sequence "
            f"per dataset item, or pass length_fn=lambda sample: <number of tokens>.")
    try:
        return len(value)
    except TypeError:
        raise SampleLengthError(
            f"{what} is of type {type(value).__name__} ({_preview(value)}), which has no length. {_FIX}") from None


def default_length(sample: Any) -> int:
    """Tokens of a processed sample: ``input_ids`` of a dict (also ``input_values`` of raw audio), else
    the sample itself or the first field of a tuple.

    A (1, L) tensor counts L. Raw text, several rows per sample, and image or audio
    features (``pixel_values``, ``input_features``: their first axis is channels or mel
    bins, not the sequence) raise ``SampleLengthError`` with the fix: tokenize in the
    dataset, or pass ``length_fn``.

    Example:
        >>> default_length({"input_ids": [1, 2, 3], "labels": [1, 2, 3]})
        3
    """
    if isinstance(sample, Mapping):
        for key in ("input_ids", "input_values"):
            if key in sample:
                return sequence_length(sample[key], f"the sample's {key!r}")
        for key, (axes, cost) in _FEATURE_KEYS.items():
            if key in sample:
                shape = tuple(getattr(sample[key], "shape", ()))
                raise SampleLengthError(
                    f"odb cannot tell the length of a sample with {key!r} of shape {shape} and no input_ids: "
                    f"{axes}, not tokens. Rule: the default length_fn reads input_ids. Fix: pass "
                    f"length_fn=lambda sample: <its cost>, e.g. {cost}.")
        raise SampleLengthError(
            f"odb cannot tell the length of a sample with fields {list(sample)}: the default length_fn reads "
            f"input_ids (or input_values). {_FIX}")
    if isinstance(sample, tuple) and sample and not isinstance(sample[0], (int, float)):
        return sequence_length(sample[0], "the sample's first field")
    return sequence_length(sample)


def seq2seq_lengths(sample: Mapping) -> Tuple[int, int]:
    """(source, target) lengths of an encoder-decoder sample with ``input_ids`` and ``labels``.

    Example:
        >>> seq2seq_lengths({"input_ids": [1, 2, 3], "labels": [4, 5]})
        (3, 2)
    """
    if not isinstance(sample, Mapping) or "input_ids" not in sample or "labels" not in sample:
        fields = list(sample) if isinstance(sample, Mapping) else type(sample).__name__
        raise SampleLengthError(
            f"seq2seq_lengths got a sample with {fields}: it reads 'input_ids' (source) and 'labels' (target). "
            f"Fix: let the dataset return both (e.g. tokenizer(text, text_target=target)), or pass a length_fn "
            f"of your own (odb.integrations.hf.enable_odb uses seq2seq_lengths for encoder-decoder models unless "
            f"given length_fn or lengths).")
    return (sequence_length(sample["input_ids"], "the sample's 'input_ids'"),
            sequence_length(sample["labels"], "the sample's 'labels'"))


def check_length_dims(token_budgets: Tuple[int, ...], length_fn: Any, lengths: Any) -> None:
    """Refuse per-dimension budgets when nothing measures that many dimensions.

    The default length_fn measures one dimension (input_ids); a tuple budget needs a
    ``length_fn`` that returns one length per budget (or known ``lengths`` with as many
    columns).

    Example:
        >>> check_length_dims((64, 32), None, None)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: token_budget=(64, 32) has one budget per length dimension, ... Fix: pass length_fn=odb.seq2seq_lengths ...
    """
    if len(token_budgets) > 1 and length_fn is None and lengths is None:
        raise ValueError(
            f"token_budget={tuple(token_budgets)} has one budget per length dimension, but the default length_fn "
            f"measures one (input_ids). Rule: a tuple budget needs a length_fn returning that many lengths. Fix: "
            f"pass length_fn=odb.seq2seq_lengths for encoder-decoder samples (source input_ids, target labels), "
            f"a length_fn of your own, or one int token_budget.")


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
    if isinstance(labels, (list, tuple)) and len(labels) == 1 and isinstance(labels[0], (list, tuple)):
        labels = labels[0]  # one row, as a (1, L) tensor
    seq = list(labels)[1:] if shift else labels
    return sum(1 for v in seq if v != ignore_index)


def batch_loss_tokens(batch: Any, label_key: str = "labels", ignore_index: int = -100, shift: bool = False,
                      shifted_key: Optional[str] = None) -> Optional[int]:
    """Supervised tokens of a collated batch as the loss sees them: labels != ignore_index; None when
    the batch holds no label tensor (the caller's fallback applies).

    ``shifted_key`` (e.g. ``"shift_labels"``, as padding-free collators provide), when the batch has
    it, is counted as is; else ``batch[label_key]``, without its first column when ``shift``
    (a causal LM's loss shifts its labels).

    Example:
        >>> batch = {"labels": torch.tensor([[-100, 5, 6], [7, 8, -100]])}
        >>> batch_loss_tokens(batch), batch_loss_tokens(batch, shift=True)
        (4, 3)
        >>> batch_loss_tokens({"input_ids": torch.ones(2, 3)}) is None
        True
    """
    if not isinstance(batch, Mapping):
        return None
    labels = batch.get(shifted_key) if shifted_key is not None else None
    if labels is None:
        labels = batch.get(label_key)
        if isinstance(labels, torch.Tensor) and shift:
            labels = labels[..., 1:]
    if not isinstance(labels, torch.Tensor):
        return None
    return int(labels.ne(ignore_index).sum())


def image_patches(sample: Any, key: str) -> int:
    """Image patches of a sample from the field ``key`` (an int or a tensor/sequence of counts)."""
    value = sample[key] if isinstance(sample, Mapping) else getattr(sample, key)
    if isinstance(value, torch.Tensor):
        return int(value.sum())
    if isinstance(value, (list, tuple)):
        return int(sum(value))
    return int(value)


def unbudgeted_labels(sample: Any, label_key: str = "labels") -> Optional[Tuple[int, int]]:
    """(input_ids length, label length) when a sample's labels form a sequence of their own; else None.

    A causal LM's labels line up with its input_ids (the same length, or one shorter when
    already shifted), so budgeting input_ids budgets them too. Labels of another length
    are a separate target sequence (encoder-decoder) that the default length_fn does not
    count.

    Example:
        >>> unbudgeted_labels({"input_ids": [1, 2, 3], "labels": [4, 5, 6, 7, 8]}), unbudgeted_labels(
        ...     {"input_ids": [1, 2, 3], "labels": [1, 2, 3]})
        ((3, 5), None)
    """
    if not isinstance(sample, Mapping) or "input_ids" not in sample or label_key not in sample:
        return None
    try:
        source, target = sequence_length(sample["input_ids"]), sequence_length(sample[label_key])
    except SampleLengthError:  # e.g. a class index as the label: nothing to budget
        return None
    return (source, target) if abs(target - source) > 1 else None


class LabelBudgetCheck:
    """Warns once (per loader) when samples carry target labels that the default length_fn leaves unbudgeted.

    ``wrap`` passes a stream of record chunks through and looks at the first ``limit``
    samples; with a ``length_fn`` of the user's it does nothing.

    Example:
        >>> import warnings
        >>> check = LabelBudgetCheck(length_fn=None, label_key="labels")
        >>> chunk = [(0, {"input_ids": [1, 2], "labels": [3, 4, 5, 6, 7]}, None)]
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     _ = list(check.wrap(iter([chunk])))
        >>> "seq2seq_lengths" in str(seen[0].message)
        True
    """

    def __init__(self, length_fn: Any, label_key: str, limit: int = 64) -> None:
        self.active = length_fn is None
        self.label_key = label_key
        self.left = limit

    def wrap(self, chunks: Iterator[List[Any]]) -> Iterator[List[Any]]:
        """The same chunks of ``(id, sample, meta)`` records, checked on the way."""
        for chunk in chunks:
            if self.active and self.left > 0:
                self._check(chunk)
            yield chunk

    def _check(self, chunk: List[Any]) -> None:
        for record in chunk[:self.left]:  # (position, index, sample, meta) records (odb.data.source.Record)
            sid, sample = record[0], record[-2]
            self.left -= 1
            found = unbudgeted_labels(sample, self.label_key)
            if found is not None:
                self.active = False
                which = "a sample" if sid is None else f"sample {sid}"
                warnings.warn(
                    f"odb: {which} has {found[0]} input_ids but {found[1]} {self.label_key!r}, and the default "
                    f"length_fn budgets input_ids only: the target sequences are not counted against token_budget, "
                    f"so batches can hold far more padded tokens than the budget. Fix: pass "
                    f"length_fn=odb.seq2seq_lengths (an int token_budget then bounds source + target; a tuple "
                    f"(source, target) bounds each), or a length_fn of your own.", stacklevel=2)
                return
