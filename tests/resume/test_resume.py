"""Exact mid-epoch resume: one round-trip harness applied to every configuration.

Interrupt an epoch after k batches (k = 0, 1, middle, last), save loader.state_dict()
through JSON, restore it into a fresh loader built with the same arguments, and check
that the rest is exactly what an uninterrupted run emits: same batches (sample ids),
same step indices, same loss scales; then the next epoch matches too. The harness is
tests/support/roundtrip.py, shared with the other tests that resume.
"""

from __future__ import annotations

import json

import pytest
import torch

import odb
from helpers import LengthDataset, StreamDataset, known_lengths, pad_collate
from roundtrip import read, round_trip, same

N = 160


def map_loader(num_workers: int, accumulation: int) -> odb.ODBDataLoader:
    return odb.ODBDataLoader(LengthDataset(known_lengths(N, 1, 60, seed=4)), token_budget=180, buffer_size=48,
                             first_window_size=16, shuffle=True, seed=11, num_workers=num_workers,
                             collate_fn=pad_collate, gradient_accumulation_steps=accumulation)


def iterable_loader(num_workers: int, accumulation: int) -> odb.ODBDataLoader:
    return odb.ODBDataLoader(StreamDataset(known_lengths(N, 1, 60, seed=5)), token_budget=180, buffer_size=48,
                             first_window_size=16, shuffle=True, seed=11, num_workers=num_workers,
                             collate_fn=pad_collate, gradient_accumulation_steps=accumulation)


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_resume_continues_exactly(kind, num_workers, accumulation):
    make = (lambda: map_loader(num_workers, accumulation)) if kind == "map" else \
        (lambda: iterable_loader(num_workers, accumulation))
    reference_loader = make()
    reference = read(reference_loader)
    reference_next = read(reference_loader)
    n = len(reference)
    assert n > 8 and sorted(i for b in reference for i in b["ids"]) == list(range(N))
    for stop in sorted({0, 1, n // 2 + 1, n - 1}):  # n // 2 + 1 falls inside an accumulation window for K=3
        got = round_trip(make, stop, next_epoch=True)  # the state goes through JSON: plain data only
        assert got.epoch == reference, f"stop={stop}: the resumed epoch differs from the uninterrupted one"
        assert got.next_epoch == reference_next, f"stop={stop}: the epoch after a resume differs"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_known_lengths_resume_inside_an_optimizer_step(num_workers):
    # Workers collate whole batches and loss scales are fixed per optimizer step from the collated
    # labels: the rest of a step split by the interruption keeps the step's saved token totals.
    lengths = known_lengths(N, 1, 60, seed=4)

    def make():
        return odb.ODBDataLoader(LengthDataset(lengths), token_budget=180, buffer_size=48, first_window_size=16,
                                 shuffle=True, seed=11, num_workers=num_workers, collate_fn=pad_collate,
                                 gradient_accumulation_steps=3, lengths=lengths)

    reference_loader = make()
    reference = read(reference_loader)
    reference_next = read(reference_loader)
    inside = [k for k, b in enumerate(reference) if b["micro"][0] > 0]  # the resume splits an optimizer step
    assert len(inside) > 4
    for stop in (inside[0], inside[len(inside) // 2], inside[-1]):
        got = round_trip(make, stop, next_epoch=True)
        assert got.epoch == reference, f"stop={stop}: the resumed epoch differs"
        assert got.next_epoch == reference_next


def test_state_after_a_full_epoch_starts_the_next_epoch():
    loader = map_loader(0, 1)
    read(loader)
    state = loader.state_dict()
    assert state["run"] is None and state["epoch"] == 1
    fresh = map_loader(0, 1)
    fresh.load_state_dict(state)
    reference = map_loader(0, 1)
    read(reference)
    assert read(fresh) == read(reference)


def test_len_after_a_resumed_epoch_counts_every_step():
    loader = map_loader(0, 1)
    full = len(read(loader))
    resumed = round_trip(lambda: map_loader(0, 1), 5, save=same).resumed
    assert len(resumed) == full


@pytest.mark.parametrize("change, message", [
    (lambda s: s.update(extra=1), "unknown keys"),
    (lambda s: s.update(world_size=2), "world size"),
    (lambda s: s.update(dataset_len=N + 1), "same dataset"),
    (lambda s: s["options"].update(buffer_size=64), "other options"),
    (lambda s: s.update(odb_state_version=99), "version"),
])
def test_load_state_dict_is_strict(change, message):
    loader = map_loader(0, 1)
    read(loader, 3)
    state = json.loads(json.dumps(loader.state_dict()))
    change(state)
    with pytest.raises(ValueError, match=message) as err:
        map_loader(0, 1).load_state_dict(state)
    assert "Fix" in str(err.value)


def test_resume_refuses_a_sampler_without_a_reproducible_order():
    ds = LengthDataset(known_lengths(N, 1, 60, seed=4))
    make = lambda: odb.ODBDataLoader(ds, token_budget=180, sampler=torch.utils.data.RandomSampler(ds),  # noqa: E731
                                     collate_fn=pad_collate, seed=1)
    loader = make()
    read(loader, 2)
    with pytest.raises(ValueError, match="not a function of"):
        make().load_state_dict(loader.state_dict())


def test_state_after_the_last_batch_but_before_exhaustion_is_the_next_epoch():
    reference = map_loader(0, 1)
    n = len(read(reference))
    loader = map_loader(0, 1)
    it = iter(loader)
    for _ in range(n):
        odb.pop_step_info(next(it))
    state = loader.state_dict()
    assert state["run"] is None and state["epoch"] == 1


def test_resume_in_a_later_epoch_sets_the_user_samplers_epoch():
    ds = LengthDataset(known_lengths(N, 1, 60, seed=4))

    def make():
        return odb.ODBDataLoader(ds, token_budget=180, buffer_size=48, sampler=odb.ShardSampler(ds, 1, 0, seed=3),
                                 collate_fn=pad_collate)

    reference = make()
    reference.set_epoch(1)
    expected = read(reference)
    got = round_trip(make, 4, epoch=1)  # the resumed loader's sampler is at epoch 0 until the state says otherwise
    assert got.epoch == expected
