"""The worker processes of an inner DataLoader, recorded as torch starts them (no private name of torch read).

torch's DataLoader starts its workers through the ``multiprocessing_context`` it was given
(``context.Process(...)``, a public argument) and hands out no other handle on them. odb gives its
inner loaders a context of the same start method (the user's context, or the default one's) whose
``Process`` also records the processes it makes; ``started_workers(loader)`` starts an iterator of
the loader and says which processes it runs on: those its ``iter()`` started, or, with
``persistent_workers`` (the iterator and its workers kept across epochs), those started before.

A context class that cannot be derived (a user's own ``BaseContext`` whose class takes arguments)
is kept as it is: its loader's workers are then not recorded, and a worker's death reaches the
other ranks through torch's own error on this rank (odb.data.worker_deaths).

Example:
    >>> from torch.utils.data import DataLoader
    >>> context = recording_context("spawn")
    >>> context.get_start_method(), isinstance(context, type(multiprocessing.get_context("spawn")))
    ('spawn', True)
    >>> batches, workers = started_workers(DataLoader(range(4), batch_size=2))  # no worker process
    >>> list(batches), workers
    ([tensor([0, 1]), tensor([2, 3])], [])
"""

from __future__ import annotations

import multiprocessing
import threading
from multiprocessing.context import BaseContext
from typing import Any, Dict, Iterator, List, Optional, Tuple

__all__ = ["WorkerRecord", "recording_context", "started_workers"]


class WorkerRecord:
    """The worker processes that a loader's ``iter()`` starts through a recording context (``add``), and
    ``start``, which runs an ``iter()`` and says which processes it runs on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: Optional[List[Any]] = None  # processes started by the iter() under way
        self._current: List[Any] = []  # the processes of the last iter() that started any

    def add(self, process: Any) -> None:
        """A process the context made (kept while an ``iter()`` of ``start`` runs)."""
        with self._lock:
            if self._pending is not None:
                self._pending.append(process)

    def start(self, loader: Any) -> Tuple[Iterator[Any], List[Any]]:
        """``iter(loader)`` and the processes it runs on: those it started, else (persistent workers) the last."""
        with self._lock:
            self._pending = []
        try:
            batches = iter(loader)
        finally:
            with self._lock:
                started, self._pending = self._pending or [], None
                if started:
                    self._current = started
                workers = list(self._current)
        return batches, workers


class _Recording:
    """What a recording context adds to its start method's context: ``Process`` also hands each process it
    makes to the context's ``odb_record``."""

    _odb_base: type  # the start method's context class, set on each derived class
    odb_record: WorkerRecord

    def Process(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 (multiprocessing's name)
        process = self._odb_base.Process(*args, **kwargs)
        self.odb_record.add(process)
        return process

    def __reduce__(self) -> Any:  # a copy is the start method's plain context (its record stays here)
        return multiprocessing.get_context, (self.get_start_method(),)  # type: ignore[attr-defined]


_CLASSES: Dict[type, type] = {}
_CLASSES_LOCK = threading.Lock()


def _recording_class(base: type) -> type:
    with _CLASSES_LOCK:
        cls = _CLASSES.get(base)
        if cls is None:
            cls = _CLASSES[base] = type(f"Recording{base.__name__}", (_Recording, base),
                                        {"_odb_base": base, "__module__": __name__,
                                         "__doc__": f"{base.__name__} whose processes odb records."})
        return cls


def recording_context(context: Any = None) -> Any:
    """A context of ``context``'s start method (None: the default one's; a start method's name; a
    ``multiprocessing`` context) that records the processes it starts; ``context`` itself when its class
    cannot be derived (see the module docstring).

    Example:
        >>> recording_context("fork").get_start_method()
        'fork'
    """
    if context is None or isinstance(context, str):
        context = multiprocessing.get_context(context)
    if isinstance(context, _Recording) or not isinstance(context, BaseContext):
        return context
    try:
        cls = _recording_class(type(context))
        recording = cls.__new__(cls)
        recording.__dict__.update(vars(context))
    except TypeError:  # a class that cannot be derived or made without arguments
        return context
    recording.odb_record = WorkerRecord()
    return recording


def started_workers(loader: Any) -> Tuple[Iterator[Any], List[Any]]:
    """``iter(loader)`` (a torch DataLoader) and the worker processes its iterator runs on: [] without worker
    processes, or where the loader's ``multiprocessing_context`` is not one of ``recording_context``'s."""
    context = loader.multiprocessing_context if loader.num_workers > 0 else None
    if not isinstance(context, _Recording):
        return iter(loader), []
    return context.odb_record.start(loader)
