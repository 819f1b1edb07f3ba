"""Lengths odb plans from without measuring them, checked against the samples the workers load.

With ``lengths=`` (known lengths) odb plans every batch before any sample is read, and with a
``length_fn`` of the user's over a sample's metadata (a length column) it plans from what that
function says. A dataset whose processing changed since (a new chat template, tokenizer or
truncation; an augmentation that lengthens samples) then under-declares some samples, and a batch
planned within the budget is collated over it: on a GPU an out-of-memory with nothing pointing at
the cause. So the workers, where each sample already is, compare:

- a sample *longer* than declared raises ``DeclaredLengthError`` naming its index, both lengths and
  the fix (on every rank: a worker's error ends its rank's epoch, and the ranks hear it at their
  next exchange);
- a sample *shorter* than declared only wastes budget: it is counted (``ShorterSamples``) and
  reported once per loader.

With ``lengths=`` the planned batch sampler hands the workers ``(index, declared)`` keys
(``DeclaredDataset`` loads ``(index, declared, sample)``), so the declared lengths travel with the
batch, never as a copy of the whole array. With a ``length_fn`` the check compares what it returned
with the sample's ``input_ids`` (``check_length_fn``), the sequence the collate pads.

Example:
    >>> check = DeclaredLengthCheck(None)
    >>> check(3, (5,), {"input_ids": [1, 2, 3, 4]})   # shorter than declared: reported, not refused
    (3, (5,), (4,))
    >>> check(3, (2,), {"input_ids": [1, 2, 3, 4]})
    Traceback (most recent call last):
    ...
    odb.data.declared.DeclaredLengthError: sample 3 was declared 2 tokens (lengths=) but loads 4: ...
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset

from odb.data.lengths import SampleLengthError, as_length_tuple, default_length, sequence_length

__all__ = ["Checked", "DeclaredDataset", "DeclaredLengthCheck", "DeclaredLengthError", "DeclaredLengths",
           "ShorterSamples", "check_length_fn"]

# (dataset index, declared lengths, measured lengths) of a sample shorter than declared.
Shorter = Tuple[int, Tuple[int, ...], Tuple[int, ...]]


class DeclaredLengthError(ValueError):
    """A loaded sample is longer than the length odb planned it with (``lengths=`` or a ``length_fn``)."""


def _shown(lengths: Sequence[int]) -> str:
    return str(lengths[0]) if len(lengths) == 1 else str(tuple(lengths))


class DeclaredLengthCheck:
    """Measures a loaded sample as odb would online (``length_fn``, default ``default_length``) and compares it
    with its declared lengths; picklable, so it runs in the workers. The default measures ``input_ids`` alone:
    with several declared dimensions it is compared with the first. A sample the default cannot read (raw text
    or a record that the collate tokenizes: what ``lengths=`` allows) is not compared; the batch the collate
    makes of it still is (odb.loader.batch_checks.BudgetCheck). A ``None`` sample is refused.

    ``__call__`` raises ``DeclaredLengthError`` for a sample longer than declared in any dimension and returns
    ``(index, declared, measured)`` for one shorter (None when equal).
    """

    def __init__(self, length_fn: Optional[Callable[[Any], Any]]) -> None:
        self.length_fn = length_fn or default_length
        self.default = length_fn is None

    def __call__(self, index: int, declared: Tuple[int, ...], sample: Any) -> Optional[Shorter]:
        ids = sample.get("input_ids") if self.default and type(sample) is dict else None
        if isinstance(ids, torch.Tensor) and ids.dim() == 1:  # the common sample, read without the general path
            measured: Tuple[int, ...] = (ids.shape[0],)
        else:
            if sample is None:
                raise SampleLengthError(f"sample {index} is None: the dataset returned no sample for index {index}. "
                                        f"Fix: make dataset[{index}] return the processed sample, or filter that "
                                        f"index out of the dataset before training.")
            try:
                measured = as_length_tuple(self.length_fn(sample), index)
            except SampleLengthError as err:
                if self.default:  # a sample odb cannot read (raw text, ids of the collate's own): the collate's to
                    return None  # read, and the batch it makes is checked against the budget (BudgetCheck)
                raise SampleLengthError(f"sample {index}: {err}") from None
        if self.default and len(declared) > 1:  # the default measures input_ids: the first of several dimensions
            declared = declared[:1]
        if measured == declared:
            return None
        if len(measured) != len(declared):
            raise DeclaredLengthError(
                f"sample {index} was declared with {len(declared)} length(s) {_shown(declared)} (lengths=) but "
                f"length_fn measures {len(measured)}: {_shown(measured)}. Rule: lengths= holds, per dataset index, "
                f"what length_fn returns for the processed sample. Fix: recompute lengths= with the same "
                f"length_fn, or drop lengths= and let odb measure each sample as it is loaded.")
        if any(m > d for m, d in zip(measured, declared)):
            raise DeclaredLengthError(
                f"sample {index} was declared {_shown(declared)} tokens (lengths=) but loads {_shown(measured)}: "
                f"longer than declared, so batches planned from lengths= would exceed the token budget. Rule: "
                f"lengths= holds the processed samples' lengths (after chat template, tokenizer, truncation and "
                f"any augmentation). Fix: recompute lengths= from the dataset as it is now, e.g. "
                f"[len(ds[i]['input_ids']) for i in range(len(ds))], or drop lengths= and let odb measure each "
                f"sample as it is loaded.")
        return index, declared, measured


def which(index: Optional[int]) -> str:
    """How messages name a sample: by its dataset index, or as one of a stream (whose workers do not number it)."""
    return "a sample of the stream" if index is None else f"sample {index}"


def check_length_fn(index: Optional[int], lengths: Tuple[int, ...], sample: Any) -> None:
    """Refuse a sample whose ``input_ids`` are longer than what the user's ``length_fn`` returned for it
    (``lengths``; its first dimension is the input's): odb would plan its batch within the budget and the
    collate would pad past it. Samples without ``input_ids`` are the length_fn's to measure alone.

    Example:
        >>> check_length_fn(0, (3,), {"input_ids": [1, 2, 3], "length": 3})
        >>> check_length_fn(7, (2,), {"input_ids": [1, 2, 3], "length": 2})
        Traceback (most recent call last):
        ...
        odb.data.declared.DeclaredLengthError: sample 7: length_fn returned 2 but its input_ids hold 3 tokens: ...
    """
    if not isinstance(sample, Mapping) or "input_ids" not in sample:
        return
    real = sequence_length(sample["input_ids"], "the sample's 'input_ids'")
    if real > lengths[0]:
        raise DeclaredLengthError(
            f"{which(index)}: length_fn returned {_shown(lengths)} but its input_ids hold {real} tokens: odb plans "
            f"its batch from the shorter length, and the collated batch would exceed the token budget. Rule: "
            f"length_fn returns at least the tokens the collate pads (a stored length column goes stale when the "
            f"tokenizer or chat template changes). Fix: measure the sample itself, e.g. "
            f"length_fn=lambda s: len(s['input_ids']), or recompute the length column.")


class DeclaredDataset(Dataset):
    """Map-style wrapper of the known-lengths inner loader: key ``(index, declared)`` loads
    ``(index, declared, dataset[index])``; a dataset's batched ``__getitems__`` is kept.

    Example:
        >>> DeclaredDataset(["a", "b"])[(1, (4,))]
        (1, (4,), 'b')
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Tuple[int, Tuple[int, ...]]) -> Tuple[int, Tuple[int, ...], Any]:
        index, declared = key
        return index, declared, self.dataset[index]

    def __getitems__(self, keys: List[Tuple[int, Tuple[int, ...]]]) -> List[Tuple[int, Tuple[int, ...], Any]]:
        batched = getattr(self.dataset, "__getitems__", None)
        if batched is None:
            return [self[key] for key in keys]
        return [(index, declared, sample) for (index, declared), sample in zip(keys, batched([k[0] for k in keys]))]


class Checked(NamedTuple):
    """A batch collated in a worker from checked samples, with those of them shorter than declared."""

    batch: Any
    shorter: Tuple[Shorter, ...]


class ShorterSamples:
    """The samples of one loader that loaded shorter than declared: counted, and reported once (a warning).

    Example:
        >>> shorter = ShorterSamples()
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     shorter.add([(4, (10,), (7,))]); shorter.add([(5, (9,), (8,))])
        >>> shorter.count, len(seen)
        (2, 1)
    """

    def __init__(self) -> None:
        self.count = 0

    def add(self, found: Sequence[Shorter], stacklevel: int = 2) -> None:
        """Count ``found``; the first time any is found, warn."""
        if not found:
            return
        if self.count == 0:
            index, declared, measured = found[0]
            warnings.warn(
                f"odb: sample {index} was declared {_shown(declared)} tokens (lengths=) but loads "
                f"{_shown(measured)}: shorter than declared, so its batch was planned larger than it is and part "
                f"of the token budget goes unused (reported once; the loader's odb_shorter_samples counts them). "
                f"Fix: recompute lengths= from the dataset as it is now, or drop lengths= to let odb measure.",
                UserWarning, stacklevel=stacklevel + 1)
        self.count += len(found)


class DeclaredLengths:
    """The main process's side of one loader's declared ``lengths=``: the keys its planned batch sampler hands
    the workers (``keys``), and the tally of samples that loaded shorter (``unwrap``).

    Example:
        >>> declared = DeclaredLengths(np.array([[5], [7]]))
        >>> declared.keys([1, 0])
        [(1, (7,)), (0, (5,))]
        >>> list(declared.unwrap(iter([Checked("batch", ())])))
        ['batch']
    """

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths
        self.shorter = ShorterSamples()

    def keys(self, indices: Sequence[int]) -> List[Tuple[int, Tuple[int, ...]]]:
        """The inner loader's keys of a planned batch of dataset ``indices`` (``DeclaredDataset``'s)."""
        rows = self.lengths[np.asarray(indices, dtype=np.int64)].tolist()
        return [(int(i), tuple(row)) for i, row in zip(indices, rows)]

    def unwrap(self, batches: Iterator[Checked], stacklevel: int = 2) -> Iterator[Any]:
        """The batches of ``Checked`` items, their shorter samples counted."""
        for checked in batches:
            self.shorter.add(checked.shorter, stacklevel + 1)
            yield checked.batch
