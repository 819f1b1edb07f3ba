"""Peers of data-parallel replicas as threads (odb.comm.threads with odb.comm.replicas): every peer of a
replica gets its replica's batches, equal to a run with one thread per replica; a peer built otherwise is
named before any batch differs. Fast checks of what tests/comm/test_mesh.py proves on real gloo processes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List

import pytest

import odb
from helpers import LengthDataset, known_lengths, on_threads, pad_collate
from odb.comm.protocol import ODBPeerMismatch
from odb.comm.replicas import Replicas
from odb.comm.threads import ThreadExchanges, ThreadRanks

LENGTHS = known_lengths(96, 1, 50, seed=4)


def threads(ranks: ThreadRanks, fn: Callable[[int, ThreadExchanges], Any]) -> List[Any]:
    return on_threads(ranks, fn)


def epochs(exchanges: ThreadExchanges, known: bool, epochs: int = 2, seed: int = 0, **options: Any) -> List[List[Any]]:
    replica, replicas = exchanges.world()
    data = LengthDataset(LENGTHS)
    sampler = odb.ShardSampler(data, num_replicas=replicas, rank=replica, seed=3)
    options = {"collate_fn": pad_collate, **options}
    loader = odb.ODBDataLoader(data, token_budget=200, sampler=sampler, seed=seed,
                               shift_labels=False, buffer_size=24, exchange=exchanges,
                               lengths=LENGTHS if known else None, **options)
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        # the step info but the seconds the loop waited (timing)
        out.append([(dataclasses.replace(odb.pop_step_info(b), loader_wait_s=0.0), b["input_ids"].tolist())
                    for b in loader])
    return out


@pytest.mark.parametrize("known", [False, True], ids=["online", "known"])
@pytest.mark.parametrize("options", [{}, {"global_batch_size": 16}], ids=["budget", "global"])
def test_every_peer_gets_its_replicas_batches(known, options):
    meshed = threads(ThreadRanks(4, replicas=Replicas.grid(2, 2)), lambda p, ex: epochs(ex, known, **options))
    plain = threads(ThreadRanks(2), lambda p, ex: epochs(ex, known, **options))
    for process, got in enumerate(meshed):
        assert not isinstance(got, BaseException), f"process {process} raised {got!r}"
        assert got == plain[process // 2], f"process {process}: not its replica's batches of a plain 2-rank run"
        assert all(len(epoch) for epoch in got)


def test_one_replica_of_two_peers_agrees_too():
    """dp 1 x tp 2: one replica, but its peers still exchange (what they measure, and the check)."""
    meshed = threads(ThreadRanks(2, replicas=Replicas.grid(1, 2)), lambda p, ex: epochs(ex, False, epochs=1))
    assert meshed[0] == meshed[1]
    ids = sorted(i for info, _ in meshed[0][0] for i in info.sample_ids)
    assert ids == list(range(len(LENGTHS)))  # every sample once (the steps of an exchanging run, in its order)


def test_a_peer_with_another_seed_is_named():
    def run(process: int, ex: ThreadExchanges) -> Any:
        return epochs(ex, False, epochs=1, **({"seed": 5} if process == 3 else {}))

    results = threads(ThreadRanks(4, replicas=Replicas.grid(2, 2)), run)
    for got in results:  # every process raises, at the first exchange, naming the option and the rank
        assert isinstance(got, odb.comm.protocol.ODBOptionMismatch), got
        assert "seed=" in str(got) and ("[3]" in str(got) or "rank 3 of 4" in str(got)), str(got)


def test_a_peer_reading_other_samples_is_named():
    """Rank 3 shards as if it were replica 0: its window sums differ from its replica's first peer's."""
    def run(process: int, ex: ThreadExchanges) -> Any:
        if process == 3:
            ex.world = lambda: (0, 2)  # type: ignore[method-assign]
        return epochs(ex, True, epochs=1, global_batch_size=16)

    results = threads(ThreadRanks(4, replicas=Replicas.grid(2, 2)), run)
    for got in results:
        assert isinstance(got, ODBPeerMismatch), got
        assert "rank 3 sent another plan message than rank 2" in str(got), str(got)


class ShiftedCollate:
    """pad_collate, its input_ids shifted by one: a peer whose processing differs from its replica's."""

    def __call__(self, samples: List[Any]) -> Any:
        batch = pad_collate(samples)
        batch["input_ids"] = batch["input_ids"] + 1
        return batch


@pytest.mark.parametrize("known", [False, True], ids=["online", "known"])
def test_check_peers_names_a_peer_whose_batches_differ(known):
    def run(process: int, ex: ThreadExchanges) -> Any:
        return epochs(ex, known, epochs=1, global_batch_size=16, check_peers=True,
                      **({"collate_fn": ShiftedCollate()} if process == 1 else {}))

    results = threads(ThreadRanks(4, replicas=Replicas.grid(2, 2)), run)
    for got in results:
        assert isinstance(got, ODBPeerMismatch), got
        assert "rank 1 sent another plan message than rank 0" in str(got), str(got)


@pytest.mark.timeout(120)
def test_peers_that_measure_differently_agree_on_auto_budgets_and_time_prices(monkeypatch):
    """token_budget="auto" with balance="time": the second peer of each replica measures 30% more memory and
    twice the seconds; the peers still train the same batches, which the budgets and prices they agreed shaped."""
    import itertools

    import torch

    from odb.epoch.ranks import RankAligner
    from odb.train.memory import ActivationMeter

    priced: List[bool] = []
    pair_cost = RankAligner.pair_cost

    def counted(self: RankAligner, group: Any) -> Any:
        priced.append(self.prices_ready)
        return pair_cost(self, group)

    monkeypatch.setattr(RankAligner, "pair_cost", counted)

    def run(process: int, ex: ThreadExchanges) -> Any:
        replica, replicas = ex.world()
        peer = process % 2
        torch.manual_seed(replica)
        model = torch.nn.Sequential(torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64))
        meter = ActivationMeter(model)
        data = LengthDataset(known_lengths(400, 1, 50, seed=1))
        loader = odb.ODBDataLoader(data, sampler=odb.ShardSampler(data, num_replicas=replicas, rank=replica, seed=3),
                                   exchange=ex, token_budget="auto", memory_cap_bytes=136 * 400, seed=0,
                                   memory_meter=lambda: None if (p := meter()) is None else p * (1.0 + 0.3 * peer),
                                   collate_fn=pad_collate, buffer_size=64, shift_labels=False, balance="time")
        ticks = itertools.count()
        loader.odb_core.auto.clock = lambda: float(next(ticks)) * (1 + peer)
        out = []
        for batch in loader:
            info = odb.pop_step_info(batch)
            torch.nn.functional.cross_entropy(model(batch["input_ids"]).flatten(0, 1), batch["labels"].flatten(),
                                              ignore_index=-100).backward()
            out.append((info.step, info.sample_ids, info.padded_tokens, info.rank_imbalance))
        return out, loader.odb_stats

    results = threads(ThreadRanks(4, replicas=Replicas.grid(2, 2)), run)
    for process, got in enumerate(results):
        assert not isinstance(got, BaseException), f"process {process}: {got!r}"
        assert got[0] == results[process // 2 * 2][0], f"process {process}: not its replica's batches"
    assert len({s[2] for s in results[0][0]}) > 3  # the budget moved (auto)
    assert sum(priced) > len(priced) // 4  # many windows paired by seconds (each process's own prices)
