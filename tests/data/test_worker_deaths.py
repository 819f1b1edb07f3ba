"""odb.data.worker_deaths: which exits of an inner loader's workers are failures the other ranks must hear."""

import multiprocessing
from multiprocessing import connection as mp_connection
from multiprocessing import forkserver

import pytest

from odb.data.worker_deaths import UNREAD_FORKSERVER_EXIT, WorkerWatch, exit_code


class _TorchIterator:
    """Stands for the two attributes of torch's multi-process iterator that the watch reads: its worker
    processes (real ones here) and whether it has begun shutting them down."""

    def __init__(self, workers):
        self._workers = workers
        self._shutdown = False


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
    batches = _TorchIterator([worker])
    watch = WorkerWatch()
    watch.follow(batches, workers=True)
    batches._shutdown = True  # torch flags its shutdown before it tells the workers to exit
    assert watch.failure() is None


@pytest.mark.timeout(60)
def test_a_forkserver_exit_that_cannot_be_read_outside_a_shutdown_is_a_failure():
    worker = _exit_read_first(0)
    batches = _TorchIterator([worker])  # held: a dropped iterator has shut its workers down
    watch = WorkerWatch()
    watch.follow(batches, workers=True)  # not shutting down: nobody else reads its exit, so the code is news
    died = watch.failure()
    assert died is not None and f"(pid {worker.pid}) exited with code {UNREAD_FORKSERVER_EXIT}" in str(died)


@pytest.mark.timeout(60)
def test_a_forkserver_worker_that_failed_during_a_shutdown_is_a_failure():
    worker = multiprocessing.get_context("forkserver").Process(target=exit, args=(3,))
    worker.start()
    mp_connection.wait([worker.sentinel], timeout=30)
    batches = _TorchIterator([worker])
    watch = WorkerWatch()
    watch.follow(batches, workers=True)
    batches._shutdown = True
    died = watch.failure()
    assert died is not None and "exited with code 3" in str(died)
