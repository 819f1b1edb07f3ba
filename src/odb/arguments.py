"""Checks of the arguments given to odb's entry points, with errors that name the value, the rule and the fix.

Example:
    >>> check_options({"max_batchsize": 4}, "ODBDataLoader", ("max_batch_size", "buffer_size"))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: ODBDataLoader got an unknown option max_batchsize=4 (did you mean max_batch_size?). Rule: ...
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping, Optional

# DataLoader arguments that size batches: odb reads the user's batch from the loader, never from its options.
_BATCH_SIZE_ARGS = ("batch_size", "batch_sampler")


def closest(name: str, choices: Iterable[str]) -> Optional[str]:
    """The choice closest to a misspelt ``name``, or None when none is close.

    Example:
        >>> closest("max_batchsize", ["max_batch_size", "buffer_size"]), closest("zzz", ["buffer_size"])
        ('max_batch_size', None)
    """
    found = difflib.get_close_matches(name, sorted(set(choices)), n=1, cutoff=0.6)
    return found[0] if found else None


def check_options(options: Mapping[str, Any], who: str, choices: Iterable[str],
                  rule: str = "odb options are odb.ODBConfig fields") -> None:
    """Refuse options that ``who`` does not take: batch-size arguments with odb's rule, others with
    the closest valid name among ``choices`` (``rule`` says what those are)."""
    for name in _BATCH_SIZE_ARGS:
        if name in options:
            raise ValueError(f"{who} got {name}={options[name]!r}: odb reads your batch where you set it "
                             f"(ODBDataLoader(batch_size=B), the batch_size of the DataLoader odb.apply converts, a "
                             f"trainer's own: TrainingArguments.per_device_train_batch_size) and cuts each optimizer "
                             f"step into micro-batches under token_budget. Fix: drop {name} here and set your batch "
                             f"there, or pass global_batch_size (samples per optimizer step, all ranks together); cap "
                             f"samples per micro-batch with max_batch_size=N.")
    choices = list(choices)
    unknown = sorted(set(options) - set(choices))
    if not unknown:
        return
    parts = []
    for name in unknown:
        near = closest(name, choices)
        parts.append(f"{name}={options[name]!r}" + (f" (did you mean {near}?)" if near else ""))
    what = "an unknown option" if len(parts) == 1 else "unknown options"
    raise TypeError(f"{who} got {what} {', '.join(parts)}. Rule: {rule}. Fix: correct the "
                    f"name (docs/options.md lists every option).")


def check_in_order(in_order: Any) -> None:
    """Refuse ``in_order=False`` (a DataLoader argument; ``TrainingArguments.dataloader_in_order``).

    odb cuts its planning windows from the sampler's order and saves its resume position
    as a count of samples of that order; workers returning samples out of order would
    make the batches depend on worker timing and a resumed run skip or repeat samples.
    """
    if in_order is False:
        raise ValueError("odb got in_order=False (DataLoader(in_order=...), TrainingArguments.dataloader_in_order): "
                         "workers would hand over samples as they finish, so the planning windows, hence the "
                         "batches, would depend on worker timing, and a resumed run would skip or repeat samples. "
                         "Rule: odb reads samples in sampler order. Fix: leave in_order=True; odb's reader thread "
                         "already keeps the workers a window ahead, so one slow sample does not stall training.")
