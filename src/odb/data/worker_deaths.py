"""The death of an inner DataLoader's worker process, seen as it happens, as the error the other ranks hear.

torch raises a worker's death on the main thread from its SIGCHLD handler, wherever that
thread is: often inside the training step, out of odb's reach. What the training thread does
next is the user's (it may keep the loader's iterator alive in a traceback while it saves a
checkpoint, exit, or be killed), so odb cannot wait for it to tell the other ranks. A
``WorkerWatch`` follows the epoch's inner iterator and, with ``on_death``, waits on its
workers' process sentinels from a thread of its own: when one exits with a failure, it hands
the death to the epoch at once (odb.loader.assembly stops the epoch, and the batch thread
announces the death to every rank at its next exchange).

A worker that exits cleanly (torch shuts its workers down at the end of an epoch, or when the
iterator is dropped), or that torch terminated while it shut them down, is no failure.

The watch knows the workers from odb.data.worker_processes (recorded as torch starts them) and
when torch shuts them down from the iterator it follows: torch shuts its workers down inside the
``next()`` that ends the iterator, or when the iterator is dropped, and the watch's wrapper of the
iterator sees both. Reading an exit races with torch, which joins the workers when it shuts them
down, while the watch reads the same exit from its own thread. A forked or spawned worker's exit is
reaped once (the loser finds no child and reads again until the code shows); a forkserver worker's
code arrives once on its sentinel, and the loser reads the end of it, which multiprocessing reports
as exit code 255. That code, and SIGTERM (torch terminates a worker that does not end in time), are
what a shutdown leaves: read before the iterator has ended, the watch waits for its end (torch joins
each worker for up to ``SHUTDOWN_JOIN_S``) and takes them for a failure only if it does not come.
"""

from __future__ import annotations

import signal
import threading
import time
import weakref
from multiprocessing import Pipe
from multiprocessing import connection as mp_connection
from multiprocessing import context as mp_context
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

from odb.data.worker_processes import started_workers

OnDeath = Callable[[RuntimeError], None]

# What multiprocessing reports for a forkserver process whose exit code it could not read from the
# sentinel: another thread read it first (or the forkserver itself died).
UNREAD_FORKSERVER_EXIT = 255
# torch joins each worker for up to this long when it shuts them down, then terminates it (its workers' status
# check interval, 5 s in torch 2.6-2.13): how long an exit that a shutdown leaves waits for the iterator's end.
SHUTDOWN_JOIN_S = 5.0


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


def exit_code(worker: Any, wait_s: float = 1.0) -> Optional[int]:
    """The exit code of ``worker``, a process whose sentinel is ready (it has exited; None if it has not
    within ``wait_s``).

    Two threads may reap one worker at once (odb's watch, and the training thread or torch's shutdown):
    for a forked or spawned worker the loser's ``waitpid`` finds no child and its poll answers None
    until the winner has stored the code, so the code is read again until it shows; for a forkserver
    worker the loser reads 255 (``UNREAD_FORKSERVER_EXIT``, see ``WorkerWatch``).

    Example:
        >>> import multiprocessing
        >>> worker = multiprocessing.get_context("fork").Process(target=abs, args=(0,))
        >>> worker.start()
        >>> exit_code(worker)
        0
    """
    end = time.monotonic() + wait_s
    try:
        worker.join(timeout=wait_s)
        code = worker.exitcode
        while code is None and time.monotonic() < end:
            time.sleep(0.005)
            code = worker.exitcode
    except ValueError:  # a closed process object
        return None
    return code


class WorkerWatch:
    """Whether a worker process of an epoch's inner loader died, as the error the other ranks should hear.

    ``start(inner)`` starts the inner loader's iterator and follows it (``follow``: an iterator and its
    worker processes); ``failure()`` asks now; ``on_death(act)`` starts a thread that waits on the
    workers and calls ``act(death)`` once, the moment one dies, whatever the training thread is doing.
    The iterator is held weakly: its workers end when it is dropped, as without the watch. The worker
    processes are kept from ``follow`` on, so a death is read from its exit code even after the
    training loop dropped the iterator (an exit right after torch raised the death): any exit but a
    clean one is a failure, except what torch's own shutdown of its workers leaves (the module's
    docstring). ``stop()`` ends the watching thread (the epoch is over). ``shutdown_join_s``: how long
    torch may take to join one worker when it shuts them down (``SHUTDOWN_JOIN_S``).

    Example:
        >>> watch = WorkerWatch()
        >>> list(watch.follow(iter([1, 2]), [])), watch.failure()
        ([1, 2], None)
    """

    def __init__(self, shutdown_join_s: float = SHUTDOWN_JOIN_S) -> None:
        self._ref: Optional[weakref.ref] = None
        self._followed: Dict[int, Any] = {}  # sentinel -> worker process, from follow()
        self._died: Optional[RuntimeError] = None
        self._lock = threading.Lock()
        self._judging = threading.Lock()  # odb's two readers of an exit (failure(), the watching thread) take turns
        self._stopped = threading.Event()
        self._ended = threading.Event()  # the iterator ended or was dropped (torch shut its workers down), or stop()
        self._join_s = float(shutdown_join_s)
        self._thread: Optional[threading.Thread] = None
        self._wake: Any = None  # the sending end of a pipe the watching thread also waits on: stop() wakes it

    def start(self, inner: Any) -> Iterator[Any]:
        """``iter(inner)`` (an inner DataLoader: its workers start here), followed; the iterator to read."""
        return self.follow(*started_workers(inner))

    def follow(self, batches: Iterator[Any], workers: Sequence[Any]) -> Iterator[Any]:
        """Watch ``workers``, the worker processes that ``batches`` (an inner DataLoader's iterator) runs on;
        returns the iterator to read in its place, which tells the watch when ``batches`` ends."""
        try:
            self._followed = {w.sentinel: w for w in workers}
        except ValueError:  # a closed process: its iterator was shut down
            self._followed = {}
        wrapped = self._reading(batches)
        ended = self._ended
        self._ref = weakref.ref(wrapped, lambda _: ended.set())  # dropped: torch shuts its workers down
        return wrapped

    def _reading(self, batches: Iterator[Any]) -> Iterator[Any]:
        try:
            yield from batches
        except GeneratorExit:  # closed: torch's iterator goes with it and shuts its workers down
            self._ended.set()
            raise
        self._ended.set()  # torch shut its workers down inside the next() that ended it (persistent ones: kept idle)

    def _judge(self, worker: Any) -> Optional[RuntimeError]:
        """The failure that ``worker`` (exited) tells of, or None."""
        with self._judging:
            code = exit_code(worker)
        died = death_of(worker) if code not in (None, 0) else None
        if died is None:
            return None
        left_by_shutdown = code == -signal.SIGTERM or (  # torch terminates a worker that does not end in time
            code == UNREAD_FORKSERVER_EXIT and isinstance(worker, mp_context.ForkServerProcess))  # read first
        if left_by_shutdown and self._ended.wait(self._join_s * (len(self._followed) + 1)):
            return None
        return died

    def failure(self, error: Optional[BaseException] = None) -> Optional[RuntimeError]:
        """The death of a worker (the first one seen, kept), or None. With an ``error`` to announce,
        waits up to 0.25 s for a death to show: the error may be its first sign (the main process can
        see a dying worker's connection reset a moment before the worker has exited)."""
        with self._lock:
            if self._died is None:
                self._died = self._ready_death(0.25 if error is not None else 0.0)
            return self._died

    def _ready_death(self, wait_s: float) -> Optional[RuntimeError]:
        workers = self._followed
        try:
            ready = mp_connection.wait(list(workers), timeout=wait_s) if workers else []
        except (OSError, ValueError):  # sentinels closed
            return None
        for sentinel in ready:
            died = self._judge(workers[sentinel])
            if died is not None:
                return died
        return None

    def on_death(self, act: OnDeath) -> Optional[threading.Thread]:
        """Call ``act(death)`` once, from a thread of the watch's own, when a followed worker dies (None:
        no workers to watch). The thread ends at ``stop()``, or once the workers are shut down."""
        workers = list(self._followed.values()) if not self._ended.is_set() else []
        if not workers or self._thread is not None:
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
        self._ended.set()
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
                if sentinel is woken or self._stopped.is_set():
                    return None  # stop(): the epoch is over
                died = self._judge(alive.pop(sentinel))
                if died is None:
                    continue  # a worker done with its share of a stream exits cleanly; or torch shut them down
                with self._lock:
                    self._died = self._died or died
                    return self._died
        return None
