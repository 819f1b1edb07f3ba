"""Samplers that repeat dataset indices: WeightedRandomSampler(replacement=True), upsampled
mixtures (a sampler listing an index twice), DistributedSampler's padding.

odb names a sample by its position in the epoch's sampler order, so every position is
emitted exactly once, however often its dataset index appears; ODBStepInfo.sample_ids
reports the dataset indices (with their repeats). Resume, known lengths and rank
alignment follow positions too.
"""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any, List, Optional, Tuple

import pytest
import torch
from torch.utils.data import DistributedSampler, WeightedRandomSampler

import odb
from dist_harness import run_ranks
from elastic_workers import repeated_shard
from helpers import LengthDataset, known_lengths, pad_collate
from roundtrip import read, round_trip

N = 150
LENGTHS = known_lengths(N, 1, 60, seed=8)


def weighted(seed: int) -> WeightedRandomSampler:
    g = torch.Generator()
    g.manual_seed(seed)
    weights = torch.linspace(0.2, 3.0, N)  # later indices drawn more often, many twice or more
    return WeightedRandomSampler(weights, num_samples=N, replacement=True, generator=g)


def upsampled() -> List[int]:
    """Every index once, then the first third again (an upsampled part of a mixture), interleaved."""
    extra = list(range(N // 3))
    return [i for pair in itertools.zip_longest(range(N), extra) for i in pair if i is not None]


def row(batch: Any, info: odb.ODBStepInfo) -> Tuple[Tuple[int, ...], int, float]:
    assert list(info.sample_ids) == list(batch["idx"])  # dataset indices, in the batch's row order
    return info.sample_ids, info.micro_batch, info.loss_scale


def batches(loader: Any, limit: Optional[int] = None) -> List[Tuple[Tuple[int, ...], int, float]]:
    return read(loader, limit, record=row)


def emitted(rows: List[Tuple[Tuple[int, ...], int, float]]) -> Counter:
    return Counter(i for ids, _, _ in rows for i in ids)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_weighted_sampler_with_replacement_emits_every_draw_once(num_workers):
    order = list(weighted(seed=5))
    assert max(Counter(order).values()) >= 3  # the sampler really repeats indices
    loader = odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=200, sampler=weighted(seed=5), seed=1,
                               buffer_size=48, collate_fn=pad_collate, num_workers=num_workers)
    got = batches(loader)
    assert emitted(got) == Counter(order)


@pytest.mark.parametrize("known", [False, True], ids=["online", "known-lengths"])
def test_upsampled_mixture_resumes_exactly_with_repeats_split_by_the_interruption(known):
    order = upsampled()

    def make():
        return odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=200, sampler=order, seed=1, buffer_size=48,
                                 first_window_size=16, collate_fn=pad_collate, gradient_accumulation_steps=2,
                                 lengths=LENGTHS if known else None)

    reference = batches(make())
    assert emitted(reference) == Counter(order)
    split = 0
    for stop in (1, 5, len(reference) // 2, len(reference) - 1):
        got = round_trip(make, stop, record=row)  # the state goes through JSON
        done = emitted(got.head)
        split += sum(1 for i, c in Counter(order).items() if c == 2 and done[i] == 1)
        assert got.epoch == reference, f"stop={stop}"
    assert split > 0, "no interruption fell between the two copies of an index"


def test_one_index_many_times_fills_one_batch_with_copies():
    loader = odb.ODBDataLoader(LengthDataset([10, 10]), token_budget=40, sampler=[1] * 8, seed=1,
                               collate_fn=pad_collate)
    got = batches(loader)
    assert [ids for ids, _, _ in got] == [(1, 1, 1, 1), (1, 1, 1, 1)]


def test_distributed_sampler_padding_resumes_exactly():
    # 151 samples on 2 "ranks": rank 1's share ends with index order[0] again (the sampler's padding).
    ds = LengthDataset(known_lengths(151, 1, 60, seed=2))

    def make():
        return odb.ODBDataLoader(ds, token_budget=200, buffer_size=48, first_window_size=16, seed=1,
                                 sampler=DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False),
                                 collate_fn=pad_collate)

    reference = batches(make())
    assert emitted(reference) == Counter(list(range(1, 151, 2)) + [0])
    assert round_trip(make, len(reference) - 2, record=row).epoch == reference


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_repeated_indices_under_ddp_every_position_once_in_equal_steps(tmp_path):
    results = run_ranks("elastic_workers:repeats_under_ddp", 2, dict(n=N, budget=200, buffer=48, num_workers=1),
                        tmp_path)
    steps = [r["steps"] for r in results]
    assert len(steps[0]) == len(steps[1])
    for column in zip(*steps):
        assert {c["step"] for c in column} == {column[0]["step"]}
        assert sum(c["scale"] for c in column) == pytest.approx(2)
    for rank, r in enumerate(results):
        assert r["order"] == repeated_shard(N, 2, rank)
        assert Counter(i for s in r["steps"] for i in s["ids"]) == Counter(r["order"])
