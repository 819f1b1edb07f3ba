"""ODBStepInfo on every kind of batch, and what its fields count."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

import odb
from helpers import LengthDataset, known_lengths, pad_collate

N = 40
LENGTHS = known_lengths(N)
BUDGET = 128
Pair = namedtuple("Pair", "input_ids idx")


class Box:
    def __init__(self, padded):
        self.padded = padded


def loader(collate_fn, **kwargs):
    return odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=BUDGET, buffer_size=16, collate_fn=collate_fn,
                             **kwargs)


def padded(samples):
    return pad_collate(samples)["input_ids"]


def test_dict_batch_loses_its_key():
    for batch in loader(pad_collate):
        assert "odb_step_info" in batch
        info = odb.pop_step_info(batch)
        assert isinstance(info, odb.ODBStepInfo)
        assert set(batch) == {"input_ids", "labels", "idx", "pid", "tag"}


@pytest.mark.parametrize("kind", [tuple, list, Pair])
def test_sequence_batches_still_unpack_and_compare_equal(kind):
    def collate(samples):
        values = (padded(samples), [s["idx"] for s in samples])
        return kind(*values) if kind is Pair else kind(values)

    for batch in loader(collate):
        ids, idx = batch  # unpacks
        assert isinstance(batch, kind) and type(batch).__name__ == kind.__name__
        assert batch == (Pair(ids, idx) if kind is Pair else kind((ids, idx)))
        if kind is Pair:
            assert batch.idx is idx
        info = odb.pop_step_info(batch)
        assert info.sample_ids == tuple(idx)
        assert not hasattr(batch, "odb_step_info")


def test_custom_object_batch():
    for batch in loader(lambda samples: Box(padded(samples))):
        info = odb.pop_step_info(batch)
        assert info.padded_tokens == batch.padded.numel()
        assert not hasattr(batch, "odb_step_info")


def test_tensor_batch():
    for batch in loader(padded):
        assert isinstance(batch, torch.Tensor)
        info = odb.pop_step_info(batch)
        assert info.local_samples == batch.shape[0] and info.padded_tokens == batch.numel()
        assert not hasattr(batch, "odb_step_info")


def test_batch_that_takes_no_attribute_is_refused():
    with pytest.raises(TypeError, match="type int.*Fix"):
        next(iter(loader(len)))


def test_pop_twice_raises():
    batch = next(iter(loader(padded)))
    odb.pop_step_info(batch)
    with pytest.raises(KeyError, match="already popped.*Fix"):
        odb.pop_step_info(batch)
    with pytest.raises(KeyError, match="Fix"):
        odb.pop_step_info({"input_ids": batch})


def test_custom_step_info_key():
    batch = next(iter(loader(pad_collate, step_info_key="meta")))
    assert "meta" in batch and "odb_step_info" not in batch
    with pytest.raises(KeyError):
        odb.pop_step_info(batch)
    assert isinstance(odb.pop_step_info(batch, key="meta"), odb.ODBStepInfo) and "meta" not in batch


def test_fields_count_the_batch():
    infos = []
    for step, batch in enumerate(loader(pad_collate, shuffle=True, seed=4)):
        info = odb.pop_step_info(batch)
        rows, width = batch["input_ids"].shape
        assert info.step == step and info.epoch == 0 and not info.is_ghost and info.world_size == 1
        assert info.local_samples == info.all_samples_this_step == rows == len(info.sample_ids)
        assert info.sample_ids == tuple(batch["idx"])
        assert info.real_tokens == sum(LENGTHS[i] for i in info.sample_ids)
        assert info.padded_tokens == rows * width <= BUDGET
        assert info.local_loss_tokens == info.global_loss_tokens == int((batch["labels"] != -100).sum())
        assert info.padding_ratio == pytest.approx(1 - info.real_tokens / info.padded_tokens)
        infos.append(info)
    assert sorted(i for info in infos for i in info.sample_ids) == list(range(N))
