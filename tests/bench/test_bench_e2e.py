"""The measurement pieces of the end-to-end and loader-cost benchmarks (correctness only, no timing)."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import DataLoader

import odb
from odb.bench.e2e import BusyDataset, GilStep, make_loaders, run_epoch, spin
from odb.bench.loader_speed import FreeDataset, ReplayBatches, python_collate, record_batches
from odb.bench.workloads import lognormal_lengths


def test_gil_step_runs_its_calibrated_loop_on_the_calling_thread():
    step = GilStep(rate=2e6)
    assert step.iterations(0.01) == 20_000 and step.iterations(0.0) == 0
    cpu0 = time.thread_time()
    step(0.05)  # 100,000 rounds of Python: CPU time of this thread, not a sleep
    assert time.thread_time() > cpu0
    assert spin(10) == sum(i & 7 for i in range(10))
    assert GilStep().rate > 0  # calibrated in this process


def test_replayed_batches_equal_odbs():
    lengths = lognormal_lengths(200.0, 0.5, 300, seed=2)
    data = FreeDataset(lengths)

    def make():
        return odb.ODBDataLoader(data, token_budget=2048, shuffle=True, seed=0, collate_fn=python_collate,
                                 buffer_size=64)

    recorded = record_batches(make())
    assert sorted(i for b in recorded for i in b) == list(range(len(lengths)))
    assert record_batches(make()) == recorded  # the same seed plans the same batches: the timed epochs replay them
    replay = DataLoader(data, batch_sampler=ReplayBatches(recorded), collate_fn=python_collate)
    odb_batches = list(make())
    assert len(replay) == len(odb_batches) == len(recorded)
    for plain, mine in zip(replay, odb_batches):
        odb.pop_step_info(mine)
        for key in ("input_ids", "attention_mask", "labels"):
            assert torch.equal(plain[key], mine[key])


def test_e2e_arms_read_every_sample_once_within_their_batch_rule():
    lengths = lognormal_lengths(100.0, 1.0, 80, seed=1, max_len=400)
    data = BusyDataset(lengths, base_s=0.0, per_token_s=0.0)
    budget = 1024
    fit_b = budget // int(lengths.max())
    makers = make_loaders(data, budget, fit_b, 8, num_workers=0, seed=0)
    assert {"odb", "plain-fit", "plain-mean"} <= set(makers)
    for name, make in makers.items():
        out = run_epoch(make(), 1e-7, budget, name == "odb", GilStep(rate=1e6))
        assert out["samples"] == len(lengths) and out["real_tokens"] == int(np.sum(lengths))
        assert out["compute_s"] == 1e-7 * out["padded_tokens"]  # nominal: what the steps cost alone
        if name in ("odb", "plain-fit", "length-grouped"):
            assert out["over_budget_batches"] == 0
        if name == "length-grouped":
            assert out["max_batch_size"] == fit_b
