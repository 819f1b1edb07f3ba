"""Worker processes end with the epoch, with an abandoned iterator, and with a killed main process."""

from __future__ import annotations

import gc
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import time

import pytest

import odb
from helpers import LengthDataset, StreamDataset, known_lengths, pad_collate

LENGTHS = known_lengths(400)
TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support")


def process_state(pid: int):
    """(state letter, parent pid) of a process, or None when it no longer exists."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], int(fields[1])


def children() -> set:
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            state = process_state(int(entry))
            if state is not None and state[1] == me:
                found.add(int(entry))
    return found


def running(pid: int) -> bool:
    state = process_state(pid)
    return state is not None and state[0] not in "ZX"


def eventually(condition, seconds: float) -> bool:
    """Polls ``condition`` until it holds or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def make(dataset=None, **kwargs):
    return odb.ODBDataLoader(LengthDataset(LENGTHS) if dataset is None else dataset, token_budget=128,
                             buffer_size=32, num_workers=2, collate_fn=pad_collate, **kwargs)


def start(loader):
    """An iterator that has produced one batch, and the worker processes it started."""
    before = children()
    it = iter(loader)
    next(it)
    workers = children() - before
    assert len(workers) == 2 and all(running(p) for p in workers)
    return it, workers


def test_workers_exit_after_a_full_epoch():
    it, workers = start(make())
    assert sum(len(b["idx"]) for b in it) > 0
    assert eventually(lambda: not workers & children(), 10), f"workers {workers & children()} remain"


@pytest.mark.parametrize("dataset", [None, StreamDataset(LENGTHS)], ids=["map", "iterable"])
def test_workers_exit_after_break(dataset):
    loader = make(dataset)
    it, workers = start(loader)
    for batch in it:
        break
    del it, batch
    gc.collect()
    assert eventually(lambda: not workers & children(), 10), f"workers {workers & children()} remain"
    assert loader.odb_stats["steps"] >= 2  # the loader itself lives on


def test_persistent_workers_live_until_the_loader_goes():
    loader = make(persistent_workers=True)
    it, workers = start(loader)
    for _ in it:
        pass
    assert all(running(p) for p in workers)
    del it, loader
    gc.collect()

    def gone() -> bool:  # exited; torch 2.6 leaves them unreaped (zombies) until multiprocessing's next poll
        multiprocessing.active_children()
        return not workers & children()

    # At once: held in a reference cycle, the loader was freed by the garbage collector, which finalized the
    # torch iterator's queues first; its workers never heard the end and torch killed them 5 s per worker later.
    assert eventually(gone, 3), f"workers {[(p, process_state(p)) for p in workers & children()]} remain"


KILLED_MAIN = """
import multiprocessing, sys, threading
sys.path.insert(0, {tests!r})
import odb
from helpers import LengthDataset, known_lengths, pad_collate
loader = odb.ODBDataLoader(LengthDataset(known_lengths(4000)), token_budget=128, buffer_size=32, num_workers=2,
                           collate_fn=pad_collate)
it = iter(loader)
next(it)
print(" ".join(str(p.pid) for p in multiprocessing.active_children()), flush=True)
threading.Event().wait()
"""


@pytest.mark.slow  # a fresh interpreter imports torch, and workers notice a dead parent every few seconds
def test_workers_exit_when_the_main_process_is_killed():
    main = subprocess.Popen([sys.executable, "-c", KILLED_MAIN.format(tests=TESTS)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([main.stdout], [], [], 120)
        line = main.stdout.readline() if ready else ""
        assert line.strip(), f"the loader process printed no worker pids: {main.poll()=}"
        workers = [int(p) for p in line.split()]
        assert len(workers) == 2 and all(running(p) for p in workers)
    finally:
        main.send_signal(signal.SIGKILL)
        main.wait()
        main.stdout.close()
        main.stderr.close()
    assert eventually(lambda: not any(running(p) for p in workers), 15), \
        f"workers {[p for p in workers if running(p)]} outlived their killed main process"
