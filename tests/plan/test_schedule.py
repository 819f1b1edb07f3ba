"""Budget schedules, set_token_budget and probe_worst_case."""

from __future__ import annotations

import pytest

import odb
from helpers import LengthDataset, known_lengths, pad_collate
from roundtrip import round_trip, sample_ids

N = 200


def make(**options):
    ds = LengthDataset(known_lengths(N, 1, 60, seed=8))
    return odb.ODBDataLoader(ds, shuffle=True, seed=3, collate_fn=pad_collate, buffer_size=40,
                             first_window_size=10, **options)


def infos(loader, limit=None):
    out = []
    for k, batch in enumerate(loader):
        out.append(odb.pop_step_info(batch))
        if limit is not None and k + 1 == limit:
            break
    return out


def test_schedule_ramps_the_budget_and_stays_exact():
    schedule = ((0, 80), (6, 160), (12, 240))
    loader = make(token_budget=240, budget_schedule=schedule, gradient_accumulation_steps=2)
    got = infos(loader)
    assert sorted(i for info in got for i in info.sample_ids) == list(range(N))
    early, late = got[:4], got[-10:]
    assert max(i.padded_tokens for i in early) <= 80  # steps planned while optimizer step < 6
    assert max(i.padded_tokens for i in late) > 160
    assert all(i.padded_tokens <= 240 for i in got)
    for start in range(0, len(got) - 1, 2):  # exact scaling: each optimizer step's scales sum to 1
        pair = got[start:start + 2]
        assert sum(i.loss_scale for i in pair) == pytest.approx(1.0)


def test_schedule_survives_resume():
    schedule = odb.linear_budget_ramp(80, 240, steps=20, points=4)
    reference = [list(i.sample_ids) for i in infos(make(token_budget=240, budget_schedule=schedule))]
    got = round_trip(lambda: make(token_budget=240, budget_schedule=schedule), 7, record=sample_ids)
    assert got.epoch == reference


def test_set_token_budget_applies_from_the_next_window():
    loader = make(token_budget=240)
    it = iter(loader)
    first = [odb.pop_step_info(next(it)) for _ in range(3)]
    loader.set_token_budget(90)
    rest = [odb.pop_step_info(b) for b in it]
    assert max(i.padded_tokens for i in first) > 90
    assert max(i.padded_tokens for i in rest[-10:]) <= 90
    assert sorted(i for info in first + rest for i in info.sample_ids) == list(range(N))


def test_probe_worst_case_runs_the_longest_samples_first():
    loader = make(token_budget=240, probe_worst_case=True)
    got = infos(loader)
    longest_of_first_window = max(known_lengths(N, 1, 60, seed=8)[i] for i in list(loader.sampler)[:40])
    first_ids = got[0].sample_ids
    assert max(known_lengths(N, 1, 60, seed=8)[i] for i in first_ids) == longest_of_first_window


@pytest.mark.parametrize("schedule", [(), ((1, 100),), ((0, 100), (0, 200)), ((0, -5),), "abc"])
def test_bad_schedules_are_refused(schedule):
    with pytest.raises(ValueError, match="Fix"):
        odb.ODBConfig(token_budget=100, budget_schedule=schedule)
