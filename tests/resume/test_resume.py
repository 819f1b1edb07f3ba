"""Exact mid-epoch resume: one round-trip harness applied to every configuration.

Interrupt an epoch after k batches (k = 0, 1, middle, last), save loader.state_dict()
through JSON, restore it into a fresh loader built with the same arguments, and check
that the rest is exactly what an uninterrupted run emits: same batches (sample ids),
same step indices, same loss scales; then the next epoch matches too.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Callable, Dict, List

import pytest
import torch

import odb
from helpers import LengthDataset, StreamDataset, known_lengths, pad_collate

N = 160


def summary(loader: Any, limit: int = -1) -> List[Dict[str, Any]]:
    out = []
    for batch in (loader if limit < 0 else itertools.islice(loader, limit)):
        info = odb.pop_step_info(batch)
        out.append({"ids": list(info.sample_ids), "step": info.step, "scale": info.loss_scale,
                    "micro": [info.micro_step, info.micro_steps], "ghost": info.is_ghost})
    return out


def map_loader(num_workers: int, accumulation: int) -> odb.ODBDataLoader:
    return odb.ODBDataLoader(LengthDataset(known_lengths(N, 1, 60, seed=4)), token_budget=180, buffer_size=48,
                             first_window_size=16, shuffle=True, seed=11, num_workers=num_workers,
                             collate_fn=pad_collate, gradient_accumulation_steps=accumulation)


def iterable_loader(num_workers: int, accumulation: int) -> odb.ODBDataLoader:
    return odb.ODBDataLoader(StreamDataset(known_lengths(N, 1, 60, seed=5)), token_budget=180, buffer_size=48,
                             first_window_size=16, shuffle=True, seed=11, num_workers=num_workers,
                             collate_fn=pad_collate, gradient_accumulation_steps=accumulation)


def round_trip(make: Callable[[], odb.ODBDataLoader], stop: int) -> List[Dict[str, Any]]:
    first = make()
    head = summary(first, limit=stop) if stop else []
    assert len(head) == stop
    state = json.loads(json.dumps(first.state_dict()))  # plain data only
    resumed = make()
    resumed.load_state_dict(state)
    return head + summary(resumed) + [{"next_epoch": summary(resumed)}]


@pytest.mark.parametrize("kind", ["map", "iterable"])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("accumulation", [1, 3])
def test_resume_continues_exactly(kind, num_workers, accumulation):
    make = (lambda: map_loader(num_workers, accumulation)) if kind == "map" else \
        (lambda: iterable_loader(num_workers, accumulation))
    reference_loader = make()
    reference = summary(reference_loader)
    reference_next = summary(reference_loader)
    n = len(reference)
    assert n > 8 and sorted(i for b in reference for i in b["ids"]) == list(range(N))
    for stop in sorted({0, 1, n // 2 + 1, n - 1}):  # n // 2 + 1 falls inside an accumulation window for K=3
        got = round_trip(make, stop)
        assert got[:-1] == reference, f"stop={stop}: the resumed epoch differs from the uninterrupted one"
        assert got[-1]["next_epoch"] == reference_next, f"stop={stop}: the epoch after a resume differs"


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
    reference = summary(reference_loader)
    reference_next = summary(reference_loader)
    inside = [k for k, b in enumerate(reference) if b["micro"][0] > 0]  # the resume splits an optimizer step
    assert len(inside) > 4
    for stop in (inside[0], inside[len(inside) // 2], inside[-1]):
        got = round_trip(make, stop)
        assert got[:-1] == reference, f"stop={stop}: the resumed epoch differs"
        assert got[-1]["next_epoch"] == reference_next


def test_state_after_a_full_epoch_starts_the_next_epoch():
    loader = map_loader(0, 1)
    summary(loader)
    state = loader.state_dict()
    assert state["run"] is None and state["epoch"] == 1
    fresh = map_loader(0, 1)
    fresh.load_state_dict(state)
    reference = map_loader(0, 1)
    summary(reference)
    assert summary(fresh) == summary(reference)


def test_len_after_a_resumed_epoch_counts_every_step():
    loader = map_loader(0, 1)
    full = len(summary(loader))
    first = map_loader(0, 1)
    summary(first, limit=5)
    resumed = map_loader(0, 1)
    resumed.load_state_dict(first.state_dict())
    summary(resumed)
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
    summary(loader, limit=3)
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
    summary(loader, limit=2)
    with pytest.raises(ValueError, match="not a function of"):
        make().load_state_dict(loader.state_dict())


def test_state_after_the_last_batch_but_before_exhaustion_is_the_next_epoch():
    reference = map_loader(0, 1)
    n = len(summary(reference))
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
    expected = summary(reference)
    first = make()
    first.set_epoch(1)
    head = summary(first, limit=4)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = make()  # its sampler is at epoch 0 until the state says otherwise
    resumed.load_state_dict(state)
    assert head + summary(resumed) == expected
