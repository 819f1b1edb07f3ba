"""The death of an inner DataLoader's worker process, seen as it happens, as the error the other ranks hear.

torch raises a worker's death on the main thread from its SIGCHLD handler, wherever that
thread is: often inside the training step, out of odb's reach. What the training thread does
next is the user's (it may keep the loader's iterator alive in a traceback while it saves a
checkpoint, exit, or be killed), so odb cannot wait for it to tell the other ranks. A
``WorkerWatch`` follows the epoch's inner iterator and, with ``on_death``, waits on its
workers' process sentinels from a thread of its own: when one exits with a failure, it hands
the death to the epoch at once (odb.loader.assembly stops the epoch, and the batch thread
announces the death to every rank at its next exchange).

A worker that torch shut down (the end of an epoch, the iterator dropped) is no failure.
"""

from __future__ import annotations

import signal
import threading
import weakref
from multiprocessing import Pipe
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Dict, List, Optional

OnDeath = Callable[[RuntimeError], None]


def death_of(worker: Any) -> Optional[RuntimeError]:
    """The error that tells of ``worker``'s end (a multiprocessing process that has exited), or None for a
    clean exit (or none yet).

    Example:
        >>> class Gone:
        ...     pid, exitcode = 41, -9
        >>> str(death_of(Gone()))[:52]
        'DataLoader worker (pid 41) was killed by SIGKILL (th'
    """
    code = worker.exitcode
    if code is None or code == 0:
        return None
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
        oom = " (the kernel's out-of-memory killer sends it when host memory runs out)" \
            if -code == signal.SIGKILL else ""
        return RuntimeError(f"DataLoader worker (pid {worker.pid}) was killed by {name}{oom}")
    return RuntimeError(f"DataLoader worker (pid {worker.pid}) exited with code {code}")


def _workers(batches: Any) -> Dict[int, Any]:
    """sentinel -> worker process of a DataLoader iterator that has not shut its workers down ({} without)."""
    if batches is None or getattr(batches, "_shutdown", True):  # shut down (it stopped its workers), or none
        return {}
    try:
        return {w.sentinel: w for w in list(getattr(batches, "_workers", ()))}  # ready once a worker exits
    except ValueError:  # a closed process: the iterator is being shut down
        return {}


def dead_worker(batches: Any, wait_s: float = 0.0) -> Optional[RuntimeError]:
    """The death of a worker of ``batches`` (a DataLoader's iterator that has not shut its workers
    down), as an error to tell the other ranks; None while every worker lives, or without workers.
    ``wait_s``: how long to wait for a death to show (the main process can see a dying worker's
    connection reset a moment before the worker has exited).

    Example:
        >>> dead_worker(iter([1, 2])) is None
        True
    """
    workers = _workers(batches)
    for sentinel in mp_connection.wait(list(workers), timeout=wait_s) if workers else ():
        worker = workers[sentinel]
        worker.join(timeout=1.0)  # its exit code (it has closed its files, so it is about to end)
        died = death_of(worker)
        if died is not None:
            return died
    return None


class WorkerWatch:
    """Whether a worker process of an epoch's inner loader died, as the error the other ranks should hear.

    ``failure()`` asks now; ``on_death(act)`` starts a thread that waits on the workers and calls
    ``act(death)`` once, the moment one dies, whatever the training thread is doing. The iterator
    is held weakly: its workers end when it is dropped, as without the watch. ``stop()`` ends the
    watching thread (the epoch is over).

    Example:
        >>> watch = WorkerWatch()
        >>> watch.follow(iter([1, 2])) is not None, watch.failure()
        (True, None)
    """

    def __init__(self) -> None:
        self._ref: Optional[weakref.ref] = None
        self._died: Optional[RuntimeError] = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._wake: Any = None  # the sending end of a pipe the watching thread also waits on: stop() wakes it

    def follow(self, batches: Any) -> Any:
        """Watch ``batches`` (an inner DataLoader's iterator); returns it."""
        try:
            self._ref = weakref.ref(batches)
        except TypeError:  # no workers to watch (an iterator that takes no weak reference)
            self._ref = None
        return batches

    def _batches(self) -> Any:
        return self._ref() if self._ref is not None else None

    def failure(self, error: Optional[BaseException] = None) -> Optional[RuntimeError]:
        """The death of a worker (the first one seen, kept), or None. With an ``error`` to announce,
        waits up to 0.25 s for a death to show: the error may be its first sign."""
        with self._lock:
            if self._died is None:
                self._died = dead_worker(self._batches(), 0.25 if error is not None else 0.0)
            return self._died

    def on_death(self, act: OnDeath) -> Optional[threading.Thread]:
        """Call ``act(death)`` once, from a thread of the watch's own, when a followed worker dies (None:
        no workers to watch). The thread ends at ``stop()``, or once the workers are shut down."""
        workers = list(_workers(self._batches()).values())
        if not workers or self._stopped.is_set() or self._thread is not None:
            return None
        woken, self._wake = Pipe(duplex=False)
        self._thread = threading.Thread(target=self._wait, args=(workers, woken, act), name="odb-worker-watch",
                                        daemon=True)
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop watching (the epoch is over: its workers may be shut down now, no failure) and wait for the
        watching thread to end (a worker process forked next must not see it)."""
        self._stopped.set()
        with self._lock:
            wake = self._wake
            if wake is not None:
                try:
                    wake.send_bytes(b"stop")
                except OSError:  # the thread has ended and closed it
                    pass
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=2.0)

    def _wait(self, workers: List[Any], woken: Any, act: OnDeath) -> None:
        try:
            died = self._first_death(workers, woken)
        finally:
            with self._lock:
                woken.close()
                self._wake.close()
        if died is not None:
            act(died)

    def _first_death(self, workers: List[Any], woken: Any) -> Optional[RuntimeError]:
        try:
            alive = {w.sentinel: w for w in workers}
        except ValueError:  # closed already: shut down
            return None
        while alive and not self._stopped.is_set():
            try:
                ready = mp_connection.wait(list(alive) + [woken])
            except (OSError, ValueError):  # its sentinels closed: the workers were shut down
                return None
            for sentinel in ready:
                if sentinel is woken:
                    return None  # stop()
                worker = alive.pop(sentinel)
                worker.join(timeout=1.0)
                died = death_of(worker)
                if died is None:
                    continue  # a worker done with its share of a stream exits cleanly
                if self._stopped.is_set() or not _workers(self._batches()):
                    return None  # torch shut the workers down itself (the epoch ended, the iterator was dropped)
                with self._lock:
                    self._died = self._died or died
                    return self._died
        return None
