"""Resume an IterableDataset through its own ``state_dict()`` / ``load_state_dict()``.

A dataset such as ``datasets.IterableDataset`` can say where its stream stands and start
there again, so a resumed epoch need not replay the stream from its beginning. The
wrapper ``StatefulStream`` runs where the dataset is iterated (each DataLoader worker, or
the main process) and hands the dataset's state, tagged with the worker's id, along with
the last sample of every transfer chunk and with the stream's last sample.
``StreamMarks`` (main process) turns those tags into restart points: positions of the
arrival order at which every worker's state is known and the workers' round-robin starts
a new round, so a fresh DataLoader whose workers load those states yields exactly the
samples that arrived from there on, in the same order. A saved state names the latest
restart point before every sample the epoch still holds; resuming replays only from there
(about a window), instead of the whole epoch so far.

The state is per worker, so resuming needs the same ``num_workers``. Each resumed epoch
loads the states into a shallow copy of the dataset, so the user's object is left as is.

Example:
    >>> marks = StreamMarks(first=0, states=None, workers=1)
    >>> marks.on_chunk(0, 2, (0, {"next": 2}))
    >>> marks.on_chunk(2, 2, (0, {"next": 4}))
    >>> marks.cut(3)
    {'start': 2, 'states': [{'next': 2}]}
"""

from __future__ import annotations

import bisect
import collections
import copy
import threading
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

from torch.utils.data import IterableDataset, get_worker_info


def has_own_state(dataset: Any) -> bool:
    """Whether an IterableDataset offers ``state_dict()`` and ``load_state_dict()``."""
    return callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))


class StatefulStream(IterableDataset):
    """Yields ``(tag, sample)``: ``tag`` is ``(worker id, dataset.state_dict())`` on the last sample
    of every ``every`` samples and on the stream's last sample, else None.

    ``start`` (``start_from``, used once per copy) holds each worker's state to load first.
    """

    def __init__(self, dataset: Any, transform: Optional[Callable[[Any], Any]], every: int) -> None:
        self.dataset, self.transform, self.every = dataset, transform, every
        self.start: Optional[List[Any]] = None

    def start_from(self, states: Optional[List[Any]]) -> None:
        """The copies made from now on (the workers', at the inner loader's next iteration) start from
        ``states`` (one per worker; None: from the stream's start)."""
        self.start = states

    def __iter__(self) -> Iterator[Tuple[Any, Any]]:
        start, self.start = self.start, None  # once, now: a persistent worker keeps this copy for later epochs
        return self._stream(start)

    def _stream(self, start: Optional[List[Any]]) -> Iterator[Tuple[Any, Any]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        dataset = self.dataset
        if start is not None and start[worker] is not None:
            dataset = _clone(dataset)  # the user's object (or the worker's copy of it) keeps no resume state
            dataset.load_state_dict(start[worker])
        held: Optional[Tuple[Any, Any]] = None
        count = 0
        for sample in dataset:
            count += 1
            tag = (worker, dataset.state_dict()) if count % self.every == 0 else None  # the state after `sample`
            if held is not None:
                yield held
            held = (tag, sample if self.transform is None else self.transform(sample))
        if held is not None:
            yield held if held[0] is not None else ((worker, dataset.state_dict()), held[1])


def _clone(dataset: Any) -> Any:
    """A shallow copy with attributes of its own (``copy.copy`` of a class whose ``__getstate__``
    returns its ``__dict__``, as datasets.IterableDataset's does, would share that dict)."""
    clone = copy.copy(dataset)
    if getattr(clone, "__dict__", None) is getattr(dataset, "__dict__", None) and hasattr(dataset, "__dict__"):
        object.__setattr__(clone, "__dict__", dict(dataset.__dict__))
    return clone


class StreamMarks:
    """Restart points of one epoch's stream, from the tags of arriving chunks (reader thread) to
    the resume state (batch thread)."""

    def __init__(self, first: int, states: Optional[List[Any]], workers: int) -> None:
        self._lock = threading.Lock()
        self._latest: List[Any] = list(states) if states is not None else [None] * max(workers, 1)
        self._cuts: Deque[Tuple[int, List[Any]]] = collections.deque([(first, list(self._latest))])
        self._last_worker: Optional[int] = None

    def on_chunk(self, start: int, count: int, tag: Any) -> None:
        """A chunk of ``count`` samples arrived at ``start``; ``tag`` = (worker, its state after it)."""
        if tag is None:
            return
        worker, state = tag
        with self._lock:
            # A worker id not above the last one's starts a round: a fresh loader starts there too.
            if self._last_worker is not None and worker <= self._last_worker and start > self._cuts[-1][0]:
                self._cuts.append((start, list(self._latest)))
            self._latest[worker] = state
            self._last_worker = worker

    def cut(self, limit: int, prune: bool = True) -> Optional[Dict[str, Any]]:
        """The latest restart point at or before position ``limit``; None if the points kept all lie
        after it. With ``prune`` (the producer's snapshots: ``limit``, the first position the epoch
        still holds, never decreases there) earlier points are dropped."""
        with self._lock:
            while len(self._cuts) > 1 and self._cuts[1][0] <= limit:
                if not prune:
                    return self._point(bisect.bisect_right([c[0] for c in self._cuts], limit) - 1)
                self._cuts.popleft()
            return self._point(0) if self._cuts[0][0] <= limit else None

    def _point(self, k: int) -> Dict[str, Any]:
        start, states = self._cuts[k]
        return {"start": start, "states": list(states)}
