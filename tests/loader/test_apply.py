"""odb.apply: converting a DataLoader that a framework already built, in place, and undoing it."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler

import odb
from helpers import LengthDataset, epoch, flat_ids, ids_of, known_lengths, pad_collate

N = 60
LENGTHS = known_lengths(N)
BUDGET = 128
DL_ITER, DL_LEN = DataLoader.__iter__, DataLoader.__len__


class ArrivalOrderRandomSampler(RandomSampler):
    """A RandomSampler (so odb infers shuffle=True) that yields indices in order."""

    def __iter__(self):
        return iter(range(len(self.data_source)))


class FrameworkLoader(DataLoader):
    def describe(self) -> str:
        return "framework"


def plain(**kwargs):
    kwargs.setdefault("batch_size", 1)
    kwargs.setdefault("collate_fn", pad_collate)
    return DataLoader(LengthDataset(LENGTHS), **kwargs)


def test_apply_converts_in_place_and_leaves_dataloader_alone():
    dl = plain()
    handle = odb.apply(dl, token_budget=BUDGET, buffer_size=32, global_batch_size=None)  # budget-filled steps
    assert handle.loader is dl
    assert type(dl) is not DataLoader and issubclass(type(dl), DataLoader)
    batches = epoch(dl)
    assert flat_ids(batches) == list(range(N)) and len(batches) < N
    assert all(b["input_ids"].numel() == b["info"].padded_tokens <= BUDGET for b in batches)
    assert handle.stats["samples"] == N and handle.config.token_budget == BUDGET
    # The DataLoader class is untouched: a loader built afterwards is an ordinary one.
    assert DataLoader.__iter__ is DL_ITER and DataLoader.__len__ is DL_LEN
    other = plain()
    assert type(other) is DataLoader and len(other) == N
    first = next(iter(other))
    assert first["input_ids"].shape[0] == 1 and "odb_step_info" not in first


def per_sample(sample):
    return dict(sample, converted_in=os.getpid())


def test_apply_to_batch_size_none_collates_per_sample_in_workers():
    dl = DataLoader(LengthDataset(LENGTHS), batch_size=None, collate_fn=per_sample, num_workers=2)
    seen_by_group_collate = []

    def group_collate(samples):
        seen_by_group_collate.append({s["converted_in"] for s in samples})
        return pad_collate(samples)

    odb.apply(dl, token_budget=BUDGET, buffer_size=32, collate_fn=group_collate)
    batches = epoch(dl)
    assert flat_ids(batches) == list(range(N))
    converted_in = set().union(*seen_by_group_collate)
    assert converted_in and os.getpid() not in converted_in  # per-sample collate ran in the workers


def test_apply_to_batch_size_none_default_group_collate():
    dl = DataLoader([torch.full((4,), i) for i in range(10)], batch_size=None)
    odb.apply(dl, token_budget=8, buffer_size=10, global_batch_size=None)
    batches = list(dl)
    infos = [odb.pop_step_info(b) for b in batches]
    assert all(b.shape == (2, 4) for b in batches)  # default_collate stacked each pair
    assert sorted(int(v) for b in batches for v in b[:, 0]) == list(range(10))
    assert [i.local_samples for i in infos] == [2] * 5


def test_apply_to_a_dataloader_subclass():
    dl = FrameworkLoader(LengthDataset(LENGTHS), batch_size=1, collate_fn=pad_collate)
    handle = odb.apply(dl, token_budget=BUDGET, buffer_size=32)
    assert isinstance(dl, FrameworkLoader) and type(dl) is not FrameworkLoader
    assert dl.describe() == "framework"
    assert flat_ids(epoch(dl)) == list(range(N))
    assert type(FrameworkLoader(LengthDataset(LENGTHS), batch_size=1)) is FrameworkLoader
    handle.remove()
    assert type(dl) is FrameworkLoader


def test_remove_restores_the_plain_loader():
    dl = plain()
    handle = odb.apply(dl, token_budget=BUDGET, buffer_size=32)
    epoch(dl)
    handle.remove()
    assert type(dl) is DataLoader and len(dl) == N
    batches = list(dl)
    assert len(batches) == N and all(b["input_ids"].shape[0] == 1 for b in batches)
    assert all("odb_step_info" not in b for b in batches)
    odb.apply(dl, token_budget=BUDGET, buffer_size=32)  # and it can be applied again
    assert flat_ids(epoch(dl)) == list(range(N))


class MyBatches(BatchSampler):
    """A batch sampler of the user's own: odb cannot tell its batches from its sampler and batch size."""


@pytest.mark.parametrize("make_loader,error,names", [
    (lambda: DataLoader(LengthDataset(LENGTHS), batch_sampler=MyBatches(SequentialSampler(range(N)), 4, False)),
     ValueError, "batch_sampler=MyBatches"),
    (lambda: DataLoader(LengthDataset(LENGTHS), batch_sampler=BatchSampler(SequentialSampler(range(N)), 1, False)),
     ValueError, "batch_sampler=BatchSampler (batch_size=None)"),
    (lambda: [1, 2, 3], TypeError, "got list"),
], ids=["own_batch_sampler", "batch_sampler", "not_a_dataloader"])
def test_apply_refuses(make_loader, error, names):
    loader = make_loader()
    with pytest.raises(error) as caught:
        odb.apply(loader, token_budget=BUDGET)
    assert names in str(caught.value) and "Fix" in str(caught.value)
    assert type(loader) in (DataLoader, list)


def test_apply_twice_is_refused():
    dl = plain()
    odb.apply(dl, token_budget=BUDGET)
    with pytest.raises(ValueError, match="already an odb loader.*Fix"):
        odb.apply(dl, token_budget=BUDGET)


def test_shuffle_is_inferred_from_random_sampler():
    # Same arrival order either way; only a shuffling loader permutes the batches of a window.
    filled = dict(token_budget=BUDGET, buffer_size=N, seed=0, global_batch_size=None)  # one window of groups
    sequential = plain(sampler=SequentialSampler(range(N)))
    odb.apply(sequential, **filled)
    randomish = plain(sampler=ArrivalOrderRandomSampler(range(N)))
    odb.apply(randomish, **filled)
    in_order, permuted = ids_of(epoch(sequential)), ids_of(epoch(randomish))
    assert sorted(map(sorted, in_order)) == sorted(map(sorted, permuted))  # same groups
    assert in_order != permuted
    firsts = [min(ids) for ids in in_order]
    assert firsts == sorted(firsts)
    forced = plain(sampler=ArrivalOrderRandomSampler(range(N)))
    odb.apply(forced, shuffle=False, **filled)
    assert ids_of(epoch(forced)) == in_order
