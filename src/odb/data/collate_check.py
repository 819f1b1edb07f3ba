"""The group collate, with a clear error when it cannot batch samples of different lengths.

odb's batches mix lengths (that is the point of a token budget), so a collate that only
stacks equal sizes (torch's ``default_collate``, used when no ``collate_fn`` is given,
or transformers' ``default_data_collator``) fails on the first batch with torch's
"stack expects each tensor to be equal size". ``PaddingHint`` re-raises such a failure
as ``RaggedBatchError``, which says that variable-length batches need a padding
collator and names some.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

from odb.data.lengths import SampleLengthError, default_length

# What torch and transformers say when asked to stack sequences of different lengths.
_SIZE_ERRORS = ("equal size", "expected sequence of length", "Unable to create tensor")


class RaggedBatchError(ValueError):
    """The collate_fn cannot batch samples of different lengths: it needs to pad."""


class PaddingHint:
    """``collate_fn`` as it is, except that its failure on samples of different lengths names the fix.

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

    def __init__(self, collate_fn: Callable[[List[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: List[Any]) -> Any:
        try:
            return self.collate_fn(samples)
        except (RuntimeError, ValueError, TypeError) as err:
            if isinstance(err, RaggedBatchError) or not any(text in str(err) for text in _SIZE_ERRORS):
                raise
            lengths = _lengths(samples)
            if lengths is None or min(lengths) == max(lengths):
                raise
            name = getattr(self.collate_fn, "__name__", type(self.collate_fn).__name__)
            raise RaggedBatchError(
                f"odb's batch holds samples of {min(lengths)} to {max(lengths)} tokens, and collate_fn={name} "
                f"failed to stack them ({type(err).__name__}: {str(err).splitlines()[0]}). Rule: token-budget "
                f"batches mix lengths, so the collate_fn must pad (torch's default_collate and transformers' "
                f"default_data_collator only stack equal sizes). Fix: pass a padding collator, e.g. "
                f"collate_fn=transformers.DataCollatorForSeq2Seq(tokenizer) (pads input_ids and labels; also for "
                f"causal LMs), DataCollatorWithPadding(tokenizer) (no labels), or a function using "
                f"torch.nn.utils.rnn.pad_sequence.") from err


def _lengths(samples: List[Any]) -> Optional[List[int]]:
    try:
        return [default_length(s) for s in samples] if samples else None
    except SampleLengthError:
        return None
