"""ODBStepInfo: what one batch means for the trainer, and how it rides on the batch."""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import MutableMapping
from typing import Any, Dict, Optional, Tuple

DEFAULT_KEY = "odb_step_info"

# The step infos that pop_step_info handed to a training loop and that nobody attached to a batch again
# since, keyed by id (a frozen dataclass compares by value; identity is what tells batches apart). The
# entries die with their infos. UnpoppedCheck reads it; ODBStepInfo itself stays immutable.
_popped: "weakref.WeakValueDictionary[int, ODBStepInfo]" = weakref.WeakValueDictionary()
# The batch a popped info was attached to again (an integration's device copy), keyed by the info's id, so
# that UnpoppedCheck looks for the key in the batch the loop got. Each entry is taken out by the check of
# the loader that handed the info out (at the next batch, the epoch's end or a new iteration).
_carriers: Dict[int, Any] = {}


@dataclasses.dataclass(frozen=True)
class ODBStepInfo:
    """Metadata of one (micro-)batch emitted by odb.

    "Step" is the optimizer step: ``optimizer_step`` counts them in the epoch, ``micro_batch`` the micro-batches
    (``micro_step`` is this micro-batch's place in its optimizer step, ``micro_steps`` their number).

    Example:
        >>> info = ODBStepInfo(micro_batch=0, epoch=0, local_samples=4, all_samples_this_step=8,
        ...                    local_loss_tokens=100, global_loss_tokens=200, real_tokens=120,
        ...                    padded_tokens=128, loss_scale=1.0, is_ghost=False)
        >>> info.padding_ratio, info.optimizer_step
        (0.0625, 0)

    Attributes:
        micro_batch: index of this micro-batch within the epoch (the same on every rank). ``step`` is its
            deprecated name (until the next release).
        epoch: the epoch it belongs to.
        local_samples: real samples in this rank's batch (0 for a ghost).
        all_samples_this_step: real samples in this micro-step (this micro-batch on every rank), all ranks
            together: summed over an optimizer step's micro-batches, the step's samples.
        local_loss_tokens: supervised tokens in this rank's batch.
        global_loss_tokens: supervised tokens over all ranks and all micro-batches of
            the optimizer step this batch belongs to (the denominator of exact scaling).
        real_tokens: non-pad tokens in this rank's batch (all length dimensions).
        padded_tokens: B x L summed over length dimensions (what the batch costs); in the
            packed layout, the length of its one row (= real_tokens: nothing is padded).
        loss_scale: multiply the model's mean loss by this before backward.
        is_ghost: this batch only keeps collectives aligned; its loss_scale is 0.
        world_size: ranks taking part.
        micro_step: index of this micro-batch within its optimizer step.
        micro_steps: micro-batches in this optimizer step (the last one of an epoch
            may hold fewer than gradient_accumulation_steps).
        sample_ids: ids of the samples in this batch (dataset indices for map-style
            datasets, arrival positions for iterable ones). A sampler that repeats an
            index (replacement, upsampling, padding) repeats it here too: odb itself
            tells samples apart by their position in the epoch's order (docs/resume.md).
        buffered_samples: processed samples odb held in memory after this batch left
            (window, carry, planned steps): the buffer occupancy.
        loader_wait_s: how long the training loop waited in ``next(loader)`` for this
            batch (reading workers' output, planning, collating).
        rank_imbalance: max over ranks of this step's cost / the mean over ranks (1.0
            with one rank).
        optimizer_step: index of the optimizer step this micro-batch belongs to, within the epoch (the same
            on every rank).
    """

    micro_batch: int
    epoch: int
    local_samples: int
    all_samples_this_step: int
    local_loss_tokens: int
    global_loss_tokens: int
    real_tokens: int
    padded_tokens: int
    loss_scale: float
    is_ghost: bool
    world_size: int = 1
    micro_step: int = 0
    micro_steps: int = 1
    sample_ids: Tuple[int, ...] = ()
    buffered_samples: int = 0
    loader_wait_s: float = 0.0
    rank_imbalance: float = 1.0
    optimizer_step: int = 0

    @property
    def step(self) -> int:
        """Deprecated name of ``micro_batch`` (the micro-batch's index in the epoch), kept until the next release:
        "step" means the optimizer step (``optimizer_step``)."""
        warnings.warn("ODBStepInfo.step is deprecated: it is the micro-batch's index, now micro_batch "
                      "(optimizer_step counts optimizer steps). Fix: read info.micro_batch.", DeprecationWarning,
                      stacklevel=2)
        return self.micro_batch

    @property
    def padding_ratio(self) -> float:
        """Share of the batch that is padding."""
        return 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0

    @property
    def is_last_micro_step(self) -> bool:
        """True when the optimizer should step after this micro-batch."""
        return self.micro_step == self.micro_steps - 1

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


_wrapped_types: Dict[type, type] = {}


def loss_scale(mode: str, tokens: int, total: int, local_total: int, world: int, planned: float) -> float:
    """The loss scale of one micro-batch under ``loss_scaling=mode`` (one definition for every path).

    ``tokens``: the micro-batch's supervised tokens; ``total``: the optimizer step's over all ranks;
    ``local_total``: the step's on this rank; ``world``: the ranks; ``planned``: the scale fixed at
    planning ("sample": world x samples / the step's samples over all ranks; "none": 1.0), which
    needs no token counts and stands. "exact" is ``world x tokens / total``, "approx"
    ``tokens / local_total`` (0.0 when the denominator is 0). Ghost batches scale by 0.0 (callers').

    Example:
        >>> loss_scale("exact", 30, 120, 60, 2, 1.0), loss_scale("approx", 30, 120, 60, 2, 1.0)
        (0.5, 0.5)
        >>> loss_scale("sample", 30, 120, 60, 2, 0.75), loss_scale("exact", 0, 0, 0, 2, 1.0)
        (0.75, 0.0)
    """
    if mode == "exact":
        return world * tokens / total if total else 0.0
    if mode == "approx":
        return tokens / local_total if local_total else 0.0
    return planned


def _carrier_type(cls: type) -> type:
    # A subclass of a tuple/list type that can hold an attribute; created once per type.
    sub = _wrapped_types.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__module__": cls.__module__})
        _wrapped_types[cls] = sub
    return sub


def attach_step_info(batch: Any, info: ODBStepInfo, key: str = DEFAULT_KEY) -> Any:
    """Put ``info`` on a collated batch and return the batch.

    A mapping gets a key; a tuple or list is returned as a same-named subclass of its
    type (it still unpacks and compares as before) with an attribute; any other object
    gets an attribute.
    """
    if _popped and _popped.pop(id(info), None) is not None:
        # an integration that took the info off re-attaches it: the training loop has yet to pop it
        _carriers[id(info)] = batch
    if isinstance(batch, MutableMapping):
        batch[key] = info
        return batch
    if isinstance(batch, (tuple, list)):
        if type(batch) in _wrapped_types.values():
            carrier = batch
        elif isinstance(batch, tuple):
            carrier = tuple.__new__(_carrier_type(type(batch)), batch)
        else:
            carrier = _carrier_type(type(batch))(batch)
        setattr(carrier, key, info)
        return carrier
    try:
        setattr(batch, key, info)
    except AttributeError:
        raise TypeError(
            f"odb cannot attach its step info to a batch of type {type(batch).__name__}: it is not a mapping, "
            f"tuple or list and takes no attributes. Fix: make collate_fn return a dict, tuple, list or an "
            f"object with a __dict__.") from None
    return batch


def pop_step_info(batch: Any, key: str = DEFAULT_KEY) -> ODBStepInfo:
    """Remove odb's metadata from a batch and return it.

    Dict-like batches lose the key ``odb_step_info``; tuples, lists, tensors and other
    objects carry it as the attribute ``odb_step_info``, which is deleted.

    Example:
        >>> batch = attach_step_info({"x": 1}, ODBStepInfo(0, 0, 1, 1, 1, 1, 1, 1, 1.0, False))
        >>> pop_step_info(batch).loss_scale, batch
        (1.0, {'x': 1})
    """
    info: Optional[ODBStepInfo]
    if isinstance(batch, MutableMapping):
        info = batch.pop(key, None)
    else:
        info = getattr(batch, key, None)
        if info is not None:
            delattr(batch, key)
    if not isinstance(info, ODBStepInfo):
        raise KeyError(
            f"batch of type {type(batch).__name__} carries no ODBStepInfo under {key!r}: either it did not come "
            f"from an odb loader or its step info was already popped. Fix: call pop_step_info once per batch "
            f"from ODBDataLoader / odb.apply.")
    _popped[id(info)] = info
    return info


class StepInfoNotPoppedWarning(UserWarning):
    """A dict batch reached the training loop and its step info was never popped (see ``UnpoppedCheck``)."""


class UnpoppedCheck:
    """Warns, once, when a dict batch an odb loader handed out was used without ``pop_step_info``.

    HF models take ``**kwargs``, so ``model(**batch)`` with the ``odb_step_info`` key still in the
    batch runs without complaint and the loss is never scaled. The loader tells this check of
    every batch it hands out; when the next one is handed out (or the epoch ends), the previous
    one's info must have gone through ``pop_step_info``. Only dict batches are checked: the key
    is what a model swallows, while an attribute carrier (tuple, list, tensor) may be read as
    ``batch.odb_step_info``. A loop that takes the key off another way (``batch.pop("odb_step_info")``)
    is not warned: the check looks for the key in the batch it handed out, and for the info in
    ``pop_step_info``'s record (a copy of the batch, e.g. Accelerate's on the device, popped by the
    loop). The cost is two dictionary lookups per batch; the batch is held only until the next one
    is handed out, as the loop's own variable holds it.

    Example:
        >>> import warnings
        >>> check = UnpoppedCheck()
        >>> info = ODBStepInfo(0, 0, 1, 1, 1, 1, 1, 1, 1.0, False)
        >>> check.handed_out(attach_step_info({"x": 1}, info), info)
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     check.finished()  # the epoch ended and nobody popped the info
        >>> "info = odb.pop_step_info(batch)" in str(seen[0].message)
        True
    """

    __slots__ = ("key", "warned", "_last", "_batch")

    def __init__(self, key: str = DEFAULT_KEY) -> None:
        self.key = key
        self.warned = False
        self._last: Optional[ODBStepInfo] = None
        self._batch: Any = None

    def handed_out(self, batch: Any, info: ODBStepInfo, stacklevel: int = 3) -> None:
        """``batch`` (carrying ``info``) goes to the training loop now; the previous batch is checked."""
        self._check(stacklevel + 1)
        # kept even once warned: the check also takes the info's entry out of _carriers
        self._last, self._batch = info, batch

    def finished(self, stacklevel: int = 3) -> None:
        """The epoch ended: check its last batch."""
        self._check(stacklevel + 1)
        self.reset()

    def reset(self) -> None:
        """A new iteration starts: forget a batch left behind by a loop that stopped early."""
        if self._last is not None:
            _carriers.pop(id(self._last), None)
        self._last = self._batch = None

    def _check(self, stacklevel: int) -> None:
        last = self._last
        if last is None:
            return
        # the batch the loop got: the one handed out, or the copy an integration attached the info to again
        batch = _carriers.pop(id(last), self._batch)
        if self.warned or _popped.get(id(last)) is last or not isinstance(batch, MutableMapping) \
                or batch.get(self.key) is not last:
            return
        self.warned = True
        warnings.warn(
            f"odb: a batch (epoch {last.epoch}, micro-batch {last.micro_batch}) went through the training loop with "
            f"batch[{self.key!r}] still in it: odb.pop_step_info was not called on it. model(**batch) "
            f"ignores the extra key (HF models take **kwargs), so the loss was not scaled by odb and the "
            f"step's token mean is off. Fix: take the info off every batch before the model sees it, and "
            f"scale the loss with it:\n"
            f"    info = odb.pop_step_info(batch)\n"
            f"    loss = odb.scale_loss(model(**batch).loss, info)\n"
            f"(with Accelerate: odb.integrations.accelerate.scale_loss(accelerator, loss, info)). "
            f"odb warns once per loader.", StepInfoNotPoppedWarning, stacklevel=stacklevel)
