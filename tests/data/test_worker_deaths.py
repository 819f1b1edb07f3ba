"""odb.data.worker_deaths: which exits of an inner loader's workers are failures the other ranks must hear."""

import gc
import multiprocessing
import threading
import time
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver

import pytest

from odb.data.worker_deaths import UNREAD_FORKSERVER_EXIT, WorkerWatch, exit_code


def _exit_read_first(code):
    """A forkserver worker that exited with ``code``, whose exit another thread read first, as torch's
    shutdown does when it joins its workers while the watch reads the same exit."""
    worker = multiprocessing.get_context("forkserver").Process(target=exit, args=(code,))
    worker.start()
    mp_connection.wait([worker.sentinel], timeout=30)
    assert forkserver.read_signed(worker.sentinel) == code  # the other thread wins the read
    mp_connection.wait([worker.sentinel], timeout=30)  # ready again once the forkserver has closed its end
    return worker


@pytest.mark.timeout(60)
def test_a_forkserver_exit_read_by_torchs_shutdown_is_no_failure():
    worker = _exit_read_first(0)
    assert exit_code(worker) == UNREAD_FORKSERVER_EXIT  # what multiprocessing tells the losing reader
    watch = WorkerWatch()
    batches = watch.follow(iter([1]), [worker])
    assert list(batches) == [1]  # torch shuts its workers down inside the next() that ends its iterator
    assert watch.failure() is None


@pytest.mark.timeout(60)
def test_an_exit_read_while_torch_shuts_down_waits_for_the_iterators_end():
    """The watch reads the exit before the iterator has ended (torch is still joining its other workers):
    it waits for the end, which comes, and then the exit is no failure."""
    worker = _exit_read_first(0)
    watch = WorkerWatch(shutdown_join_s=30.0)
    batches = watch.follow(iter([1]), [worker])
    next(batches)
    ending = threading.Timer(0.3, lambda: list(batches))  # the last next(), after torch's shutdown
    ending.start()
    started = time.monotonic()
    assert watch.failure() is None
    assert 0.2 < time.monotonic() - started < 10.0
    ending.join()


@pytest.mark.timeout(60)
def test_a_dropped_iterator_shut_its_workers_down():
    worker = _exit_read_first(0)
    watch = WorkerWatch(shutdown_join_s=30.0)
    batches = watch.follow(iter([1, 2]), [worker])
    next(batches)
    del batches  # torch's iterator goes with it, and shuts its workers down
    gc.collect()
    assert watch.failure() is None


@pytest.mark.timeout(60)
def test_a_forkserver_exit_that_cannot_be_read_outside_a_shutdown_is_a_failure():
    worker = _exit_read_first(0)
    watch = WorkerWatch(shutdown_join_s=0.1)
    batches = watch.follow(iter([1, 2]), [worker])  # held and not ended: nobody else reads its exit, so the code
    next(batches)                                   # is news (once the time torch's shutdown could take is over)
    died = watch.failure()
    assert died is not None and f"(pid {worker.pid}) exited with code {UNREAD_FORKSERVER_EXIT}" in str(died)


@pytest.mark.timeout(60)
def test_a_forkserver_worker_that_failed_during_a_shutdown_is_a_failure():
    worker = multiprocessing.get_context("forkserver").Process(target=exit, args=(3,))
    worker.start()
    mp_connection.wait([worker.sentinel], timeout=30)
    watch = WorkerWatch()
    batches = watch.follow(iter([]), [worker])
    assert list(batches) == []  # the iterator ended: torch shut its workers down
    died = watch.failure()
    assert died is not None and "exited with code 3" in str(died)
