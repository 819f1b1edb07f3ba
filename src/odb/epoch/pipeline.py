"""Runs an epoch's producer on a background thread; the training thread only pops ready batches.

As DataLoader's pin-memory thread does: planning, rank alignment, the user's collate and
pinning happen off the training thread, and a bounded queue holds the ready batches.
Errors raised by the producer are re-raised on the training thread, with their traceback.

When the producer ends early (it raised, the training thread stopped it, or aborted it
with an error of its own), ``announce(error or None)`` runs once, after the error is
queued for the training thread: under torch.distributed it tells the other ranks at
their next exchange, so they stop too instead of waiting for this rank.

A batch may also be handed over uncollated (``LazyBatch``): the first thread that needs it collates
it (``made``), so a batch thread that falls behind does not keep the training thread waiting.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Iterator, List, Optional

from odb.comm.protocol import owe_announcements

_END = object()
Announce = Callable[[Optional[BaseException]], None]


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class BatchPipeline:
    """Iterates what ``produce`` yields, ``depth`` items ahead (``depth=0``: on the caller's thread).

    With ``make``, each item is queued first and then finished by ``make(item)`` on the
    producer's thread, or on the consumer's when it takes the item before that: ``make``
    must be thread-safe, do the work once and return the finished item each time.

    Example:
        >>> p = BatchPipeline(iter(range(5)), depth=2)
        >>> list(p)
        [0, 1, 2, 3, 4]
    """

    def __init__(self, produce: Iterator[Any], depth: int, name: str = "odb-batches",
                 announce: Optional[Announce] = None, make: Optional[Callable[[Any], Any]] = None,
                 start: bool = True) -> None:
        self._produce = produce
        self._make = make
        self.wait_s = 0.0  # time the consumer waited in next(), in all
        self.last_wait_s = 0.0  # ... for the last item
        self._stop = threading.Event()
        self._queue: Optional["queue.Queue[Any]"] = None
        self._thread: Optional[threading.Thread] = None
        self._done = False
        self._announce = announce
        self._ended = False  # the producer ran to its end: nothing to announce
        self._aborted: Optional[BaseException] = None
        self._announced = threading.Lock()  # taken by the one announcement
        self._owes = threading.Event()  # an announcement is due (the producer failed or was aborted) ...
        self._told = threading.Event()  # ... and was made (or could not be)
        if announce is not None:
            owe_announcements(self)  # a process that exits now waits for it (odb.comm.dist)
        if depth > 0:
            self._queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
            if start:  # else at the first next(): after the caller forked its worker processes
                self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        error: Optional[BaseException] = None
        try:
            for item in self._produce:
                if not self._put(item):
                    break
                if self._make is not None:
                    self._make(item)  # unless the consumer got to it first
            else:
                self._ended = True
                self._put(_END)
                return
        except BaseException as err:  # raised again on the training thread, then told to the other ranks
            if not self._stop.is_set():  # (after a stop, an error of the closed source is no failure)
                error = err
                self._owes.set()
                self._put(_Failure(err))
        self._end(error if error is not None else self._aborted)

    def _end(self, error: Optional[BaseException]) -> None:
        """Announce how the producer ended early, once (on the producer's thread, or its own)."""
        if self._announce is None or self._ended or not self._announced.acquire(blocking=False):
            return
        try:
            self._announce(error)
        except Exception:  # best effort: the exchange may be broken too; this rank raises its own error anyway
            pass
        finally:
            self._told.set()

    def announcement_settled(self) -> bool:
        """No announcement of this pipeline's failure is due but not made yet (odb.comm.protocol)."""
        return self._announce is None or self._ended or not self._owes.is_set() or self._told.is_set()

    def _end_elsewhere(self, error: Optional[BaseException]) -> None:
        # depth=0: the producer ran on the training thread, which must not wait for the other ranks.
        if self._announce is not None and not self._ended:
            self._owes.set()
            threading.Thread(target=self._end, args=(error,), name="odb-announce", daemon=True).start()

    def __iter__(self) -> "BatchPipeline":
        return self

    @property
    def done(self) -> bool:
        """The consumer has seen the end (or a failure), or the pipeline was stopped."""
        return self._done

    def __next__(self) -> Any:
        if self._done:
            if self._aborted is not None:
                raise self._aborted
            raise StopIteration
        t0 = time.perf_counter()
        if self._queue is None:
            try:
                item = next(self._produce)
            except StopIteration:
                self._done = self._ended = True
                raise
            except BaseException as err:
                self._done = True
                self._end_elsewhere(err)
                raise
        else:
            item = self._get()
        if item is not _END and not isinstance(item, _Failure):
            if self._make is not None:
                try:
                    item = self._make(item)
                except BaseException as err:  # the producer announces it to the other ranks, as its own
                    self.abort(err)
                    raise
            # What the loop waited for this item (the wait for the end of the epoch is no batch's).
            self.last_wait_s = time.perf_counter() - t0
            self.wait_s += self.last_wait_s
            return item
        if item is _END:
            self._done = True
            raise StopIteration
        self._done = True
        raise item.error

    def _get(self) -> Any:
        if self._thread.ident is None and not self._stop.is_set():
            self._thread.start()
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():  # it was stopped, or died
                    return _Failure(self._aborted or RuntimeError("odb's batch thread ended without a result"))

    def stop(self) -> None:
        """Ask the producer to stop at its next item (returns at once); it announces a stop."""
        self._done = True
        self._owes.set()
        self._stop.set()
        if self._queue is None or self._thread.ident is None:  # no producer thread runs to announce it
            self._end_elsewhere(self._aborted)

    def abort(self, error: BaseException) -> None:
        """Stop because of ``error``, raised on the training thread by odb's own checks: the producer
        announces it instead of a plain stop (even when it is blocked on a full queue)."""
        if self._aborted is None:
            self._aborted = error
        self.stop()

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the producer; True when its thread has ended (it may be inside a collective)."""
        self.stop()
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        while thread.is_alive() and timeout_s > 0:
            try:
                while True:
                    self._queue.get_nowait()  # unblock a producer waiting on a full queue
            except queue.Empty:
                pass
            thread.join(timeout=min(0.05, timeout_s))
            timeout_s -= 0.05
        return not thread.is_alive()


class LazyBatch:
    """A planned batch whose collate runs once, on the first thread that asks for it.

    The batch thread collates every batch right after queuing it; when it falls behind
    (a training step that holds the GIL makes it wait for the GIL at every torch call),
    the training thread collates the batch it needs itself instead of waiting for those
    hand-offs. One lock per epoch: the user's collate_fn never runs on two threads at once.

    Example:
        >>> import threading
        >>> b = LazyBatch([1, 2], None, lambda samples, info: sum(samples), threading.Lock())
        >>> b.get(), b.get()
        (3, 3)
    """

    __slots__ = ("_samples", "_info", "_finish", "_lock", "_batch", "_error")

    def __init__(self, samples: List[Any], info: Any, finish: Callable[[List[Any], Any], Any],
                 lock: Any) -> None:
        self._samples: Optional[List[Any]] = samples
        self._info, self._finish, self._lock = info, finish, lock
        self._batch: Any = None
        self._error: Optional[BaseException] = None

    def get(self) -> Any:
        """The collated batch (collated now, on this thread, unless it already is)."""
        with self._lock:
            if self._samples is not None:
                samples, self._samples = self._samples, None
                try:
                    self._batch = self._finish(samples, self._info)
                except BaseException as err:  # raised to every thread that asks
                    self._error = err
            if self._error is not None:
                raise self._error
            return self._batch


def made(item: Any) -> Any:
    """``(batch, cursor)`` with a LazyBatch collated (odb.epoch.pipeline's ``make``)."""
    batch, cursor = item
    return (batch.get(), cursor) if type(batch) is LazyBatch else item
