"""Step compositions through the real loader (``composition=``): ``"length_grouped"`` makes each optimizer step of
length-similar samples on 1-3 ranks (thread ranks), padded and packed, lengths known, measured online or streamed,
every step planned per rank or across ranks; every sample once an epoch; the loss scaling exact (float64 updates
equal a plain loop over the same steps); exact resume inside a step and inside a composed block, and on fewer
ranks. The default (``"sampler"``) keeps the sampler's steps: tests/loader/test_global_batch.py."""

from __future__ import annotations

import collections
import itertools
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
import torch
from torch.utils.data import IterableDataset

import odb
from helpers import IGNORE, LengthDataset, known_lengths, make_sample
from roundtrip import read, round_trip
from test_global_batch import collate_for, model_of, relative_error, split_steps, token_loss, train
from test_thread_ranks import ok, run_ranks

N = 96
LENGTHS = known_lengths(N, 2, 60, seed=21)
BUDGET = 160
G = 12  # a multiple of 1, 2, 3 ranks: 8 steps an epoch
BLOCK = 4


def loader(rank: int, world: int, exchange: Any, source: str, layout: str, step_plan: str = "global",
           **options: Any) -> odb.ODBDataLoader:
    common: Dict[str, Any] = dict(token_budget=BUDGET, global_batch_size=G, composition="length_grouped",
                                  composition_block_steps=BLOCK, layout=layout, collate_fn=collate_for(layout),
                                  seed=4, shift_labels=True, step_plan=step_plan, **options)
    if exchange is not None:
        common["exchange"] = exchange
    if source == "streamed":
        return odb.ODBDataLoader(_RankStream(rank, world), **common)
    ds = LengthDataset(LENGTHS)
    sampler = odb.ShardSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=2)
    return odb.ODBDataLoader(ds, sampler=sampler, lengths=LENGTHS if source == "known" else None, **common)


class _RankStream(IterableDataset):
    """Rank ``rank`` of ``world`` streams samples rank, rank + world, ..."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def __iter__(self):
        return (make_sample(i, LENGTHS[i]) for i in range(self.rank, N, self.world))


def epochs(world: int, source: str, layout: str, step_plan: str = "global", count: int = 2
           ) -> List[List[List[Tuple[Dict[str, Any], odb.ODBStepInfo]]]]:
    """Per epoch, per rank: (batch, step info) of every batch."""
    def one(rank: int, exchange: Any) -> List[List[Tuple[Dict[str, Any], odb.ODBStepInfo]]]:
        ld = loader(rank, world, exchange, source, layout, step_plan)
        out = []
        for epoch in range(count):
            ld.set_epoch(epoch)
            out.append([(b, odb.pop_step_info(b)) for b in ld])
        return out

    per_rank = [one(0, None)] if world == 1 else ok(run_ranks(world, one))
    return [[per_rank[r][e] for r in range(world)] for e in range(count)]


def step_samples(per_rank: List[List[Tuple[Dict[str, Any], odb.ODBStepInfo]]], source: str = "known"
                 ) -> List[List[int]]:
    """Each optimizer step's dataset indices, all ranks together (a stream's from its padded batches' idx: its
    step infos name arrival positions)."""
    steps = [split_steps(batches) for batches in per_rank]
    return [sorted(i for r in range(len(per_rank)) for b, info in steps[r][k] if not info.is_ghost
                   for i in (b["idx"] if source == "streamed" else info.sample_ids)) for k in range(len(steps[0]))]


def spread(steps: List[List[int]]) -> float:
    """Mean over full steps of (longest - shortest sample)."""
    return float(np.mean([max(LENGTHS[i] for i in s) - min(LENGTHS[i] for i in s) for s in steps if len(s) == G]))


@pytest.mark.parametrize("world,step_plan", [(1, "global"), (2, "global"), (3, "global"), (2, "rank")])
@pytest.mark.parametrize("source,layout", [("online", "padded"), ("known", "padded"), ("streamed", "padded"),
                                           ("online", "packed")])
def test_length_grouped_steps(world: int, step_plan: str, source: str, layout: str) -> None:
    """Every sample once an epoch, G per step, steps far more length-alike than the sampler's, and the updates of a
    plain loop over the same steps (token mean of each step, float64)."""
    for per_rank in epochs(world, source, layout, step_plan):
        steps = step_samples(per_rank, source)
        assert collections.Counter(i for s in steps for i in s) == collections.Counter(range(N))
        assert [len(s) for s in steps] == [G] * (N // G)
        random_steps = [list(range(k * G, (k + 1) * G)) for k in range(N // G)]  # the data is in random order
        assert spread(steps) < 0.6 * spread(random_steps)
    got_steps, got = train(per_rank)
    if source != "streamed":  # (a stream's step infos name arrival positions, its batches the dataset's idx)
        assert got_steps == steps
    assert relative_error(got, plain_loop(steps)) < 1e-12


def plain_loop(steps: List[List[int]]) -> List[torch.Tensor]:
    """The reference: one SGD step per optimizer step, the token mean over its samples (each padded alone)."""
    model = model_of()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ds = LengthDataset(LENGTHS)
    for step in steps:
        batches = [collate_for("padded")([ds[i]]) for i in step]
        total = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in batches)
        opt.zero_grad()
        (sum(token_loss(model, b, "sum") for b in batches) / total).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_adjacent_steps_do_not_follow_each_other() -> None:
    """The block's steps come shuffled: adjacent steps' mean lengths correlate far less than sorted ones would."""
    steps = step_samples(epochs(1, "known", "padded", count=1)[0])
    means = [float(np.mean([LENGTHS[i] for i in s])) for s in steps]
    assert odb.plan.steps.composition.adjacent_correlation(means) < 0.5
    assert odb.plan.steps.composition.adjacent_correlation(sorted(means)) > 0.9


@pytest.mark.parametrize("source", ["online", "known"])
@pytest.mark.parametrize("stop", [3, 9, 14])  # inside the first block's steps, inside a step, a later block
def test_resume_inside_a_step_and_a_block(source: str, stop: int) -> None:
    make = lambda: loader(0, 1, None, source, "padded")  # noqa: E731
    reference = read(make())
    got = round_trip(make, stop)
    assert got.epoch == reference
    assert got.state["run"]["position"]["composed"] is not None


def test_resume_on_fewer_ranks_emits_every_sample_once() -> None:
    """Two ranks stop inside a composed block; one rank resumes from both states (re-partition)."""
    stop = 5

    def head(rank: int, exchange: Any) -> Tuple[List[int], Dict[str, Any]]:
        ld = loader(rank, 2, exchange, "online", "padded")
        batches = [(b, odb.pop_step_info(b)) for b in itertools.islice(ld, stop)]
        return [i for b, info in batches if not info.is_ghost for i in info.sample_ids], ld.state_dict()

    results = ok(run_ranks(2, head))
    resumed = loader(0, 1, None, "online", "padded")
    resumed.load_state_dict([state for _, state in results])
    rest = [i for b in resumed for info in [odb.pop_step_info(b)] if not info.is_ghost for i in info.sample_ids]
    assert collections.Counter(results[0][0] + results[1][0] + rest) == collections.Counter(range(N))


def test_composition_needs_the_users_batch() -> None:
    with pytest.raises(ValueError, match="composition='length_grouped'.*Fix: pass your batch"):
        odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=BUDGET, composition="length_grouped",
                          global_batch_size=None, collate_fn=collate_for("padded"))
    with pytest.raises(ValueError, match="composition='bogus': names no step composition"):
        odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=BUDGET, batch_size=4, composition="bogus")
