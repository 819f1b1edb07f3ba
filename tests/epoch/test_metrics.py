"""Metrics: per step in ODBStepInfo, cumulative in loader.odb_stats."""

from __future__ import annotations

import numpy as np
import pytest

import odb
from helpers import LengthDataset, known_lengths, pad_collate
from odb.epoch.simulate import simulate_ranks


def test_step_and_epoch_metrics_add_up():
    lengths = known_lengths(300, 1, 80, seed=9)
    loader = odb.ODBDataLoader(LengthDataset(lengths), token_budget=200, buffer_size=64, shuffle=True, seed=1,
                               collate_fn=pad_collate, num_workers=2)
    infos = [odb.pop_step_info(b) for b in loader]
    stats = loader.odb_stats
    assert stats["steps"] == len(infos) and stats["samples"] == 300
    assert stats["real_tokens"] == sum(lengths) == sum(i.real_tokens for i in infos)
    assert stats["padded_tokens"] == sum(i.padded_tokens for i in infos)
    assert stats["padding_ratio"] == pytest.approx(1 - sum(lengths) / stats["padded_tokens"])
    assert stats["loss_tokens"] == sum(i.local_loss_tokens for i in infos)
    assert stats["mean_batch_size"] == pytest.approx(300 / len(infos))
    assert stats["wait_s"] == pytest.approx(sum(i.loader_wait_s for i in infos))
    assert all(i.loader_wait_s >= 0 for i in infos)
    occupancy = [i.buffered_samples for i in infos]
    assert stats["buffered_max"] == max(occupancy) and 0 < max(occupancy) <= 64 + 32 + 64  # window + carry
    assert occupancy[-1] == 0  # nothing held once the epoch is emitted
    assert stats["rank_imbalance"] == 1.0 and all(i.rank_imbalance == 1.0 for i in infos)


def test_rank_imbalance_per_step_matches_the_step_costs():
    rng = np.random.default_rng(3)
    shards = [rng.integers(1, 60, size=120) for _ in range(3)]
    infos = simulate_ranks(shards, odb.ODBConfig(token_budget=150, buffer_size=32), seed=0)["infos"]
    for column in zip(*infos):
        costs = np.array([0 if i.is_ghost else i.padded_tokens for i in column], dtype=float)
        expected = costs.max() / costs.mean() if costs.mean() else 1.0
        assert {round(i.rank_imbalance, 9) for i in column} == {round(expected, 9)}


def test_oom_counts_reach_odb_stats():
    import torch

    from odb.train.oom import train_step_with_oom_fallback
    from oom_workers import OOMLM, token_mean_loss

    lengths = known_lengths(40, 2, 12, seed=2)
    loader = odb.ODBDataLoader(LengthDataset(lengths), token_budget=120, buffer_size=40, collate_fn=pad_collate)
    model = OOMLM(0, 2, "forward")  # more than 2 rows: a (fake) out-of-memory error
    before = loader.odb_stats
    assert not any(k.startswith("oom") for k in before)
    wide = 0
    for batch in loader:
        info = odb.pop_step_info(batch)
        wide += info.local_samples > 2
        batch = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        train_step_with_oom_fallback(lambda b: token_mean_loss(model, b), batch, info, model=model,
                                     counters=loader.odb_oom_counters)
    stats = loader.odb_stats
    assert wide >= 1 and stats["oom_split_micro_batches"] == wide  # exactly the batches over 2 rows were split
    assert stats["oom_errors"] >= wide
    assert torch.isfinite(next(model.parameters()).grad).all()
