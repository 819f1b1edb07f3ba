"""odb.data.worker_processes: the worker processes of a real torch DataLoader, recorded as torch starts them."""

import multiprocessing
import os
import pickle

import pytest
from torch.utils.data import DataLoader, Dataset

from odb.data.worker_processes import recording_context, started_workers


class Pids(Dataset):
    """Each item is the pid of the process that loaded it."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return os.getpid()


def _pids(batches):
    return {int(p) for batch in batches for p in batch}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_the_recorded_processes_are_the_ones_that_load(method):
    context = recording_context(method)
    loader = DataLoader(Pids(), batch_size=1, num_workers=2, multiprocessing_context=context)
    batches, workers = started_workers(loader)
    assert len(workers) == 2 and all(type(w).__name__ == f"{method.capitalize().replace('server', 'Server')}Process"
                                     for w in workers)
    assert _pids(batches) == {w.pid for w in workers} and os.getpid() not in {w.pid for w in workers}
    if method == "fork":  # (the others start alike, only slower)
        batches, again = started_workers(loader)  # a new iterator: new workers
        assert _pids(batches) == {w.pid for w in again} and not {w.pid for w in again} & {w.pid for w in workers}


@pytest.mark.timeout(120)
def test_persistent_workers_are_the_first_iterators():
    loader = DataLoader(Pids(), batch_size=1, num_workers=2, persistent_workers=True,
                        multiprocessing_context=recording_context(None))
    first, workers = started_workers(loader)
    assert _pids(first) == {w.pid for w in workers}
    second, kept = started_workers(loader)  # torch keeps the iterator and its workers: none started
    assert kept == workers and _pids(second) == {w.pid for w in workers}


def test_the_start_method_is_kept_and_a_copy_is_the_plain_context():
    assert recording_context(None).get_start_method() == multiprocessing.get_start_method()
    for method in ("fork", "spawn", "forkserver"):
        context = recording_context(multiprocessing.get_context(method))
        assert context.get_start_method() == method and recording_context(context) is context
        assert pickle.loads(pickle.dumps(context)) is multiprocessing.get_context(method)


def test_without_workers_or_a_recording_context_no_process_is_named():
    assert started_workers(DataLoader(Pids(), num_workers=0))[1] == []
    loader = DataLoader(Pids(), batch_size=4, num_workers=1, multiprocessing_context="fork")  # not odb's context
    batches, workers = started_workers(loader)
    assert workers == [] and len(_pids(batches)) == 1
