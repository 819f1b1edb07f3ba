"""The pipelined loader: what runs where, read-ahead, state of consumed batches, shutdown, errors."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import odb
from dist_harness import run_ranks
from helpers import LengthDataset, known_lengths, pad_collate
from roundtrip import round_trip, sample_ids, same
from odb.epoch.pipeline import BatchPipeline


def _ids(batches):
    return [list(odb.pop_step_info(b).sample_ids) for b in batches]


def _odb_threads():
    return [t for t in threading.enumerate() if t.name.startswith("odb-")]


@pytest.mark.parametrize("ready, off_thread", [(4, True), (0, False)])
def test_collate_runs_off_the_training_thread_unless_ready_batches_is_0(ready, off_thread):
    seen = set()

    def collate(samples):
        seen.add(threading.current_thread() is threading.main_thread())
        return pad_collate(samples)

    ds = LengthDataset(known_lengths(200, 1, 40, seed=1))
    loader = odb.ODBDataLoader(ds, token_budget=200, collate_fn=collate, ready_batches=ready, buffer_size=64)
    count = 0
    for batch in loader:  # a loop slower than the batch thread: it finds every batch collated
        count += len(odb.pop_step_info(batch).sample_ids)
        time.sleep(0.01)
    assert count == 200
    assert seen == {not off_thread}


def test_the_training_thread_collates_what_the_batch_thread_has_not_reached():
    # A batch thread held back (here: its collates are slow; in training, a step that holds the GIL) may leave
    # batches to the training thread, which then collates them itself: every batch once, the same batches.
    # Which thread takes a queued batch first is a race (the batch thread queues a batch, then collates it), so
    # that the training thread does take some over is shown deterministically on the pipeline below
    # (test_the_consumer_finishes_items_the_producer_has_not_reached); this machine's timing decided it here
    # (one 2-core machine lost every hand-off in three epochs, three runs in a row).
    calls = []

    def collate(samples):
        on_main = threading.current_thread() is threading.main_thread()
        if not on_main:
            time.sleep(0.05)
        calls.append(on_main)
        return pad_collate(samples)

    ds = LengthDataset(known_lengths(200, 1, 40, seed=1))
    lazy = odb.ODBDataLoader(ds, token_budget=200, collate_fn=collate, buffer_size=64, shuffle=True, seed=0)
    inline = odb.ODBDataLoader(ds, token_budget=200, collate_fn=pad_collate, buffer_size=64, shuffle=True, seed=0,
                               ready_batches=0)
    ids = _ids(lazy)
    assert len(calls) == len(ids)  # each batch collated exactly once
    assert _ids(inline) == ids  # the same batches as the batch thread's own collates give


def test_the_consumer_finishes_items_the_producer_has_not_reached():
    # The producer queues an item, then finishes it; here it is slow to start finishing (50 ms, where the waiting
    # consumer takes a queued item within microseconds), so the consumer finishes every item itself, once.
    made = []
    lock = threading.Lock()

    def make(item):
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.05)
        with lock:
            if item["done"] is None:
                item["done"] = threading.current_thread() is threading.main_thread()
                made.append(item["k"])
            return item["k"], item["done"]

    pipe = BatchPipeline(iter([{"k": k, "done": None} for k in range(20)]), depth=2, make=make)
    out = list(pipe)
    assert [k for k, _ in out] == list(range(20)) and sorted(made) == list(range(20))
    assert sum(on_main for _, on_main in out) >= 15, out  # the consumer took over (nearly) every item


def test_batch_pipeline_finishes_each_item_once_on_either_thread():
    made = []
    lock = threading.Lock()

    def make(item):
        with lock:
            if item["done"] is None:
                item["done"] = threading.current_thread().name
                made.append(item["k"])
            return item["k"], item["done"]

    pipe = BatchPipeline(iter([{"k": k, "done": None} for k in range(50)]), depth=3, make=make)
    out = list(pipe)
    assert [k for k, _ in out] == list(range(50)) and sorted(made) == list(range(50))


def test_a_collate_error_on_the_training_thread_is_announced_once():
    told = []

    def make(item):
        raise KeyError(f"bad {item}")

    pipe = BatchPipeline(iter(range(5)), depth=2, make=make, announce=told.append)
    with pytest.raises(KeyError):
        next(pipe)
    pipe.close()
    assert len(told) == 1 and isinstance(told[0], KeyError)  # the other ranks hear of the error, not a stop


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_do_not_depend_on_threads_or_timing(num_workers):
    ds = LengthDataset(known_lengths(400, 1, 60, seed=2))
    runs = []
    for ready in (0, 1, 8):
        loader = odb.ODBDataLoader(ds, token_budget=300, shuffle=True, seed=5, collate_fn=pad_collate,
                                   num_workers=num_workers, ready_batches=ready, window_budgets=4)
        runs.append(_ids(loader))
    assert runs[0] == runs[1] == runs[2]
    assert sorted(i for b in runs[0] for i in b) == list(range(400))


def test_workers_read_a_full_window_ahead_of_a_slow_loop():
    # Inner prefetch alone holds num_workers x prefetch_factor x transfer_chunk_size = 2 x 2 x 4 = 16
    # samples; the reader thread keeps reading until a whole next window (64 samples) is buffered.
    ds = LengthDataset([10] * 400)
    loader = odb.ODBDataLoader(ds, token_budget=100, collate_fn=pad_collate, num_workers=2, prefetch_factor=2,
                               transfer_chunk_size=4, buffer_size=64, window_budgets=None, first_window_size=64)
    it = iter(loader)
    next(it)
    deadline = time.monotonic() + 20
    while loader.odb_stats["read_ahead_max"] < 64 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader.odb_stats["read_ahead_max"] >= 64
    assert sum(len(odb.pop_step_info(b).sample_ids) for b in it) == 400 - 10


def test_window_closes_at_its_token_size():
    # window_budgets=2, budget 100: a window closes at 200 real tokens, i.e. 20 samples of 10.
    ds = LengthDataset([10] * 100)
    loader = odb.ODBDataLoader(ds, token_budget=100, collate_fn=pad_collate, window_budgets=2,
                               first_window_size=1000, max_carry=0)
    batches = _ids(loader)
    assert loader.odb_stats["windows"] == 5 and all(len(b) == 10 for b in batches)


def test_state_is_that_of_the_consumed_batches_while_the_thread_runs_ahead():
    ds = LengthDataset(known_lengths(600, 1, 60, seed=3))
    kw = dict(token_budget=300, shuffle=True, seed=7, collate_fn=pad_collate, num_workers=2, ready_batches=8,
              window_budgets=3, gradient_accumulation_steps=2)
    full = _ids(odb.ODBDataLoader(ds, **kw))
    # taken while the iteration runs, 0.5 s after the 5th batch: the batch thread fills its queue and plans ahead
    got = round_trip(lambda: odb.ODBDataLoader(ds, **kw), 5, record=sample_ids, save=same, live=True, pause=0.5)
    assert got.state["run"]["position"]["step"] == 5
    assert got.epoch == full


def test_break_ends_the_threads():
    before = set(_odb_threads())  # other tests' abandoned iterators are not this test's business
    ds = LengthDataset(known_lengths(2000, 1, 60, seed=4))
    loader = odb.ODBDataLoader(ds, token_budget=300, collate_fn=pad_collate, num_workers=2, window_budgets=4)
    for k, _ in enumerate(loader):
        if k == 3:
            break
    deadline = time.monotonic() + 10
    while set(_odb_threads()) - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert set(_odb_threads()) - before == set()
    assert sum(len(i) for i in _ids(loader)) == 2000  # and the next epoch is whole


class _Boom(RuntimeError):
    pass


def test_an_error_in_collate_reaches_the_training_thread():
    def collate(samples):
        raise _Boom("bad batch")

    loader = odb.ODBDataLoader(LengthDataset([5] * 50), token_budget=50, collate_fn=collate)
    with pytest.raises(_Boom, match="bad batch"):
        next(iter(loader))


def test_an_error_in_a_worker_reaches_the_training_thread():
    loader = odb.ODBDataLoader([{"input_ids": torch.ones(3)}, {"no_ids": 1}], token_budget=50, num_workers=1,
                               collate_fn=list)
    with pytest.raises(TypeError, match="length_fn"):
        list(loader)


def test_batch_pipeline_stops_a_producer_blocked_on_a_full_queue():
    produced = []

    def produce():
        for k in range(1000):
            produced.append(k)
            yield k

    p = BatchPipeline(produce(), depth=2)
    assert next(p) == 0
    assert p.close(timeout_s=5.0)
    assert len(produced) < 10


@pytest.mark.dist
def test_rank0_state_before_training_then_break_then_full_epoch_under_ddp(tmp_path):
    params = {"n": 300, "budget": 300, "buffer": 32, "num_workers": 1, "break_after": 2}
    out = run_ranks("pipeline_workers:save_before_first_epoch_then_break_then_full_epoch", world=2,
                    params=params, tmp=tmp_path)
    assert [o["probe"] for o in out] == [2.0, 2.0]
    ids = sorted(i for o in out for i in o["ids"])
    assert ids == list(range(300))


# ---- known lengths: workers collate whole batches ---------------------------------------------


def _collate_where(samples):
    batch = pad_collate(samples)
    batch["collated_in"] = os.getpid()
    return batch


def test_known_lengths_let_workers_collate_the_same_batches():
    lengths = known_lengths(500, 1, 60, seed=1)
    ds = LengthDataset(lengths)
    kw = dict(token_budget=300, shuffle=True, seed=3, num_workers=2, window_budgets=4,
              gradient_accumulation_steps=2, collate_fn=_collate_where)
    online = [odb.pop_step_info(b) for b in odb.ODBDataLoader(ds, **kw)]
    batches = list(odb.ODBDataLoader(ds, lengths=lengths, **kw))
    known = [odb.pop_step_info(b) for b in batches]
    assert {b["collated_in"] for b in batches} - {os.getpid()} and os.getpid() not in {b["collated_in"] for b in batches}
    assert [i.sample_ids for i in known] == [i.sample_ids for i in online]
    assert [(i.loss_scale, i.local_loss_tokens, i.global_loss_tokens) for i in known] == [
        (i.loss_scale, i.local_loss_tokens, i.global_loss_tokens) for i in online]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_known_lengths_resume_exactly(num_workers):
    lengths = known_lengths(400, 1, 60, seed=5)
    ds = LengthDataset(lengths)
    kw = dict(token_budget=300, shuffle=True, seed=7, collate_fn=pad_collate, num_workers=num_workers,
              window_budgets=3, gradient_accumulation_steps=2, lengths=lengths)
    full = _ids(odb.ODBDataLoader(ds, **kw))
    got = round_trip(lambda: odb.ODBDataLoader(ds, **kw), 5, record=sample_ids, save=same, live=True)
    assert got.epoch == full


def test_known_lengths_must_cover_the_dataset():
    with pytest.raises(ValueError, match="lengths= for 3 samples but the dataset has 4"):
        odb.ODBDataLoader(LengthDataset([5] * 4), token_budget=50, lengths=[5] * 3, collate_fn=list)


# ---- len(): the step estimate ------------------------------------------------------------------


class _CountingDataset(LengthDataset):
    reads = 0

    def __getitem__(self, index):
        type(self).reads += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("known", [False, True])
def test_len_is_close_to_the_real_step_count_and_computed_once(known):
    import numpy as np

    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(200), 1.0, 3000).astype(int), 1, 2000).tolist()
    ds = _CountingDataset(lengths)
    loader = odb.ODBDataLoader(ds, token_budget=4096, shuffle=True, seed=1, collate_fn=pad_collate,
                               lengths=lengths if known else None)
    _CountingDataset.reads = 0
    estimate = len(loader)
    probe_reads = _CountingDataset.reads
    assert probe_reads == 0 if known else 0 < probe_reads < 3000
    assert len(loader) == estimate and _CountingDataset.reads == probe_reads  # cached
    real = sum(1 for _ in loader)
    assert abs(estimate / real - 1) <= 0.10, (estimate, real)
    assert len(loader) == real  # exact once an epoch has run


def test_first_window_emits_a_batch_and_windows_ramp_down_at_the_end():
    import numpy as np

    from odb.plan.windows.window import plan_stream

    cfg = odb.ODBConfig(token_budget=100, first_window_size=4, pack_efficiency=1.0, window_budgets=2)
    lengths = np.array([61, 47, 33, 29] + [20] * 200)
    windows = list(plan_stream(lengths, cfg))
    assert windows[0].groups, "a first window holding a budget's worth must emit a batch"
    sizes = [sum(len(g) for g in w.groups) for w in windows]
    assert sum(sizes) == len(lengths)
    from odb.plan.windows.window import window_limits

    assert window_limits(cfg, 20, remaining=30) == (15, 200) and window_limits(cfg, 20, remaining=3) == (4, 200)
