"""N real ODBDataLoaders in N threads of one process, exchanging through odb.comm.threads.

The same protocol as the gloo runs of tests/comm (status words, reasons, announce,
ODBRankFailed), with a barrier for the all_gather: fast checks of what the multi-process
tests prove on real processes (those stay: they cover gloo, workers and DDP).
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Dict, List, Optional

import pytest
from torch.utils.data import DataLoader

import odb
from helpers import IGNORE, LengthDataset, known_lengths, on_threads, pad_collate
from odb.comm.protocol import ODBRankFailed
from odb.comm.threads import ThreadExchanges, ThreadRanks

N = 160
LENGTHS = known_lengths(N, 1, 50, seed=4)


def run_ranks(world: int, fn: Callable[[int, ThreadExchanges], Any], timeout_s: float = 40.0) -> List[Any]:
    """``fn(rank, exchanges)`` on ``world`` threads; every rank's result, or its exception."""
    return on_threads(ThreadRanks(world, timeout_s=timeout_s), fn, timeout_s)


def ok(results: List[Any]) -> List[Any]:
    for rank, r in enumerate(results):
        if isinstance(r, BaseException):
            raise AssertionError(f"rank {rank} raised {type(r).__name__}: {r}") from r
    return results


def make(rank: int, world: int, exchanges: Optional[ThreadExchanges], **options: Any) -> odb.ODBDataLoader:
    ds = LengthDataset(LENGTHS)
    sampler = odb.ShardSampler(ds, num_replicas=world, rank=rank, seed=3)
    options = {"token_budget": 240, "buffer_size": 32, "collate_fn": pad_collate, "seed": 0, "shift_labels": False,
               **options}
    return odb.ODBDataLoader(ds, sampler=sampler, exchange=exchanges, **options)


def steps(batches: Any) -> List[Dict[str, Any]]:
    out = []
    for batch in batches:
        info = odb.pop_step_info(batch)
        out.append({"step": info.micro_batch, "micro": info.micro_step, "ids": list(info.sample_ids),
                    "idx": [int(i) for i in batch["idx"]] if "idx" in batch else [], "ghost": info.is_ghost,
                    "scale": info.loss_scale, "local": info.local_loss_tokens, "global": info.global_loss_tokens,
                    "all": info.all_samples_this_step, "samples": info.local_samples,
                    "supervised": int((batch["labels"] != IGNORE).sum()) if "labels" in batch else 0})
    return out


def supervised_total() -> int:
    """Supervised tokens of the whole dataset, read by one loader on one process (the reference)."""
    loader = odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=240, buffer_size=32, collate_fn=pad_collate,
                               shift_labels=False)
    return sum(s["local"] for s in steps(loader))


def check_aligned(per_rank: List[List[Dict[str, Any]]], world: int, accumulation: int) -> None:
    """Equal steps; per optimizer step (its micro-batches on every rank): one global token count on every rank, the sum of the ranks' local
    counts; exact scales add up to world (per step, over ranks and micro-batches); every sample once."""
    assert len({len(s) for s in per_rank}) == 1, f"step counts differ: {[len(s) for s in per_rank]}"
    by_step: Dict[int, List[Dict[str, Any]]] = {}
    for rank_steps in per_rank:
        for s in rank_steps:
            by_step.setdefault(s["step"] - s["micro"], []).append(s)  # step counts micro-batches
        assert [s["step"] for s in rank_steps] == [s["step"] for s in per_rank[0]]  # the same micro-batches
    for step, entries in by_step.items():
        assert len(entries) <= world * accumulation
        assert len({e["global"] for e in entries}) == 1, f"step {step}: ranks disagree on the token total"
        assert entries[0]["global"] == sum(e["local"] for e in entries)
        assert sum(e["scale"] for e in entries) == pytest.approx(world)
        for e in entries:
            assert e["local"] == e["supervised"]  # the token count is the batch's own
            if e["ghost"]:
                assert (e["samples"], e["scale"], e["ids"]) == (0, 0.0, [])
            else:
                assert e["ids"] == e["idx"]
    emitted = [i for rank_steps in per_rank for s in rank_steps for i in s["ids"]]
    assert sorted(emitted) == list(range(N)), "a sample was emitted twice or never"
    assert sum(s["local"] for rank_steps in per_rank for s in rank_steps) == supervised_total()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,accumulation", [(2, 1), (3, 2)], ids=["2-ranks", "3-ranks-accumulation-2"])
def test_ranks_as_threads_run_equal_steps_with_exact_scales(world, accumulation):
    def rank_run(rank: int, exchanges: ThreadExchanges) -> List[Dict[str, Any]]:
        return steps(make(rank, world, exchanges, gradient_accumulation_steps=accumulation))

    check_aligned(ok(run_ranks(world, rank_run)), world, accumulation)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world,accumulation", [(2, 2), (3, 1)], ids=["2-ranks-accumulation-2", "3-ranks"])
def test_known_lengths_exchange_each_step_across_thread_ranks(world, accumulation):
    def rank_run(rank: int, exchanges: ThreadExchanges) -> List[Dict[str, Any]]:
        loader = make(rank, world, exchanges, lengths=LENGTHS, gradient_accumulation_steps=accumulation)
        return steps(loader)

    check_aligned(ok(run_ranks(world, rank_run)), world, accumulation)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("known", [False, True], ids=["online", "known-lengths"])
def test_resume_mid_epoch_on_thread_ranks_continues_exactly(known):
    world, stop = 2, 3
    options: Dict[str, Any] = dict(gradient_accumulation_steps=2, first_window_size=16)
    if known:
        options["lengths"] = LENGTHS

    def rank_run(rank: int, exchanges: ThreadExchanges) -> Dict[str, Any]:
        reference = steps(make(rank, world, exchanges, **options))
        first = make(rank, world, exchanges, **options)
        batches = iter(first)
        head = steps(itertools.islice(batches, stop))
        state = json.loads(json.dumps(first.state_dict()))
        del batches  # the interrupted epoch ends here: its ranks stop together
        resumed = make(rank, world, exchanges, **options)
        resumed.load_state_dict(state)
        return {"reference": reference, "resumed": head + steps(resumed), "state": state}

    results = ok(run_ranks(world, rank_run))
    for rank, r in enumerate(results):
        assert r["state"]["run"] is not None and r["state"]["rank"] == rank
        assert r["resumed"] == r["reference"], f"rank {rank}: the resumed epoch differs"
    union = sorted(i for r in results for s in r["resumed"] for i in s["ids"])
    assert union == sorted(i for r in results for s in r["reference"] for i in s["ids"]) == list(range(N))


class FailingCollate:
    """pad_collate, raising on the batch that holds sample ``bad``."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def __call__(self, samples: List[Dict[str, Any]]) -> Dict[str, Any]:
        if any(int(s["idx"]) == self.bad for s in samples):
            raise ValueError(f"collate cannot handle sample {self.bad}")
        return pad_collate(samples)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("known", [False, True], ids=["online", "known-lengths"])
def test_a_rank_failure_reaches_the_other_thread_rank_as_odb_rank_failed(known):
    world, bad_rank = 2, 1
    bad = list(odb.ShardSampler(LengthDataset(LENGTHS), num_replicas=world, rank=bad_rank, seed=3))[40]

    def rank_run(rank: int, exchanges: ThreadExchanges) -> List[Dict[str, Any]]:
        collate = FailingCollate(bad) if rank == bad_rank else pad_collate
        loader = make(rank, world, exchanges, collate_fn=collate, lengths=LENGTHS if known else None)
        return steps(loader)

    results = run_ranks(world, rank_run)
    mine, other = results[bad_rank], results[1 - bad_rank]
    assert isinstance(mine, ValueError) and f"sample {bad}" in str(mine)
    assert isinstance(other, ODBRankFailed), f"the other rank got {other!r}"
    assert other.rank == bad_rank and f"sample {bad}" in other.reason
    assert f"rank {bad_rank} failed" in str(other)


@pytest.mark.timeout(60)
def test_a_rank_with_token_budget_auto_beside_one_with_an_int_budget_is_named():
    """Ranks with and without token_budget="auto" send headers of one shape, so the options check names
    token_budget on both (the auto rank's longer header failed in numpy: 'all input arrays must have the
    same shape')."""
    from odb.comm.protocol import ODBOptionMismatch

    def rank_run(rank: int, exchanges: ThreadExchanges) -> List[Dict[str, Any]]:
        auto = {"token_budget": "auto", "memory_cap_bytes": 10**7, "memory_meter": lambda: None} if rank == 0 else {}
        return steps(make(rank, 2, exchanges, **auto))

    results = run_ranks(2, rank_run)
    assert all(isinstance(r, ODBOptionMismatch) for r in results), results
    assert "token_budget='auto' here" in str(results[0]) and "token_budget=240 here" in str(results[1])


@pytest.mark.timeout(60)
def test_thread_ranks_refuse_exchange_with_a_process_group_or_a_local_loader():
    ranks = ThreadRanks(2)
    with pytest.raises(ValueError, match="distributed=False"):
        make(0, 2, ranks.exchanges(0), distributed=False)
    with pytest.raises(ValueError, match="process_group"):
        make(0, 2, ranks.exchanges(0), process_group=object())
    with pytest.raises(ValueError, match="rank=2"):
        ranks.exchanges(2)


@pytest.mark.timeout(60)
def test_odb_apply_takes_an_exchange_too():
    world = 2

    def rank_run(rank: int, exchanges: ThreadExchanges) -> List[Dict[str, Any]]:
        ds = LengthDataset(LENGTHS)
        dl = DataLoader(ds, batch_size=1, sampler=odb.ShardSampler(ds, num_replicas=world, rank=rank, seed=3),
                        collate_fn=pad_collate)
        odb.apply(dl, token_budget=240, buffer_size=32, seed=0, shift_labels=False, exchange=exchanges)
        return steps(dl)

    check_aligned(ok(run_ranks(world, rank_run)), world, 1)
