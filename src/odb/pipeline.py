"""Runs an epoch's producer on a background thread; the training thread only pops ready batches.

As DataLoader's pin-memory thread does: planning, rank alignment, the user's collate and
pinning happen off the training thread, and a bounded queue holds the ready batches.
Errors raised by the producer are re-raised on the training thread, with their traceback.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Iterator, Optional

_END = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


class BatchPipeline:
    """Iterates what ``produce`` yields, ``depth`` items ahead (``depth=0``: on the caller's thread).

    Example:
        >>> p = BatchPipeline(iter(range(5)), depth=2)
        >>> list(p)
        [0, 1, 2, 3, 4]
    """

    def __init__(self, produce: Iterator[Any], depth: int, name: str = "odb-batches") -> None:
        self._produce = produce
        self.wait_s = 0.0  # time the consumer waited in next(), in all
        self.last_wait_s = 0.0  # ... for the last item
        self._stop = threading.Event()
        self._queue: Optional["queue.Queue[Any]"] = None
        self._thread: Optional[threading.Thread] = None
        self._done = False
        if depth > 0:
            self._queue = queue.Queue(maxsize=depth)
            self._thread = threading.Thread(target=self._run, name=name, daemon=True)
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
        try:
            for item in self._produce:
                if not self._put(item):
                    return
            self._put(_END)
        except BaseException as err:  # raised again on the training thread
            self._put(_Failure(err))

    def __iter__(self) -> "BatchPipeline":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        t0 = time.perf_counter()
        if self._queue is None:
            try:
                item = next(self._produce)
            except StopIteration:
                self._done = True
                raise
        else:
            item = self._get()
        if item is not _END and not isinstance(item, _Failure):
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
        while True:
            try:
                return self._queue.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    return _Failure(RuntimeError("odb's batch thread ended without a result"))

    def stop(self) -> None:
        """Ask the producer to stop at its next item (returns at once)."""
        self._done = True
        self._stop.set()

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
