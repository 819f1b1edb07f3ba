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
        assert info.micro_batch == step and info.epoch == 0 and not info.is_ghost and info.world_size == 1
        assert info.local_samples == info.all_samples_this_step == rows == len(info.sample_ids)
        assert info.sample_ids == tuple(batch["idx"])
        assert info.real_tokens == sum(LENGTHS[i] for i in info.sample_ids)
        assert info.padded_tokens == rows * width <= BUDGET
        assert info.local_loss_tokens == info.global_loss_tokens == int((batch["labels"] != -100).sum())
        assert info.padding_ratio == pytest.approx(1 - info.real_tokens / info.padded_tokens)
        infos.append(info)
    assert sorted(i for info in infos for i in info.sample_ids) == list(range(N))


# ---- a forgotten pop_step_info is reported ---------------------------------------------------------------------
def not_popped(seen):
    return [w for w in seen if issubclass(w.category, odb.step_info.StepInfoNotPoppedWarning)]


@pytest.mark.parametrize("known", [False, True], ids=["online", "known-lengths"])
def test_forgotten_pop_is_warned_once_with_the_fix(known):
    """model(**batch) swallows the key (HF forwards take **kwargs): the next batch reports it, once per loader."""
    data = loader(pad_collate, lengths=LENGTHS if known else None)
    with pytest.warns(odb.step_info.StepInfoNotPoppedWarning) as seen:
        for epoch in range(2):
            data.set_epoch(epoch)
            for step, batch in enumerate(data):
                if epoch == step == 0:
                    assert not not_popped(seen), "the first batch cannot have been forgotten yet"
                model_kwargs = dict(batch)  # what model(**batch) would receive, odb_step_info included
                assert "odb_step_info" in model_kwargs
    [warning] = not_popped(seen)
    text = str(warning.message)
    assert "batch['odb_step_info'] still in it" in text and "micro-batch 0" in text
    assert "info = odb.pop_step_info(batch)" in text and "odb.scale_loss(model(**batch).loss, info)" in text
    assert warning.filename == __file__, "the warning points at the training loop"


@pytest.mark.parametrize("known", [False, True], ids=["online", "known-lengths"])
def test_last_batch_of_an_epoch_is_checked_too(known):
    data = odb.ODBDataLoader(LengthDataset([5, 6]), token_budget=64, collate_fn=pad_collate,
                             lengths=[5, 6] if known else None)
    with pytest.warns(odb.step_info.StepInfoNotPoppedWarning, match="epoch 0, micro-batch 0"):
        assert len(list(data)) == 1


def test_popped_batches_and_attribute_carriers_warn_nothing(recwarn):
    for batch in loader(pad_collate):
        odb.pop_step_info(batch)
    for batch in loader(padded):  # a tensor carries the info as an attribute: read it any way you like
        assert batch.odb_step_info.local_samples == batch.shape[0]
    for batch in loader(pad_collate, step_info_key="meta"):
        odb.pop_step_info(batch, key="meta")
    data = loader(pad_collate)
    for batch in data:  # a loop that stops early leaves its last batch behind: not a forgotten pop
        odb.pop_step_info(batch)
        break
    batch = next(iter(data))
    odb.pop_step_info(batch)
    assert not not_popped(recwarn.list)


def test_a_key_taken_off_by_hand_is_not_warned_about(recwarn):
    """batch.pop('odb_step_info') trains correctly (the model never sees the key): no warning."""
    data = loader(pad_collate)
    for _ in range(2):
        for batch in data:
            batch.pop("odb_step_info")
    assert not not_popped(recwarn.list)


def test_a_reattached_info_must_be_popped_again():
    """An integration that takes the info off and puts it back (Accelerate's device copy) leaves the pop to the loop."""
    info = odb.pop_step_info(next(iter(loader(pad_collate))))
    check = odb.step_info.UnpoppedCheck()
    copy = odb.attach_step_info({"input_ids": torch.ones(1, 2)}, info)
    check.handed_out(copy, info)
    with pytest.warns(odb.step_info.StepInfoNotPoppedWarning):
        check.finished()


# ---- labels that need shift_labels -------------------------------------------------------------------------------
def shift_warnings(seen):
    return [w for w in seen if issubclass(w.category, odb.loader.batch_checks.ShiftLabelsWarning)]


def make_labels(samples):
    """A collate that makes the labels, as DataCollatorForLanguageModeling(mlm=False): input_ids, pads ignored."""
    return pad_collate([{**s, "labels": s["input_ids"]} for s in samples])  # padded with -100


def test_causal_labels_without_shift_labels_are_warned_once_with_the_counts(recwarn):
    """The quickstart without shift_labels: labels repeat input_ids, the HF loss drops each row's first one."""
    for batch in loader(pad_collate):
        info = odb.pop_step_info(batch)
        if "first" not in locals():
            first = (info.local_loss_tokens, int((batch["labels"][:, 1:] != -100).sum()), batch["labels"].shape[0])
    [warning] = shift_warnings(recwarn.list)
    counted, shifted, rows = first
    assert counted != shifted
    text = str(warning.message)
    assert f"odb counted {counted} supervised tokens in the first batch ({rows} rows)" in text
    assert f"averaging over {shifted}" in text and "Fix: ODBDataLoader(..., shift_labels=True)" in text
    assert warning.filename == __file__


@pytest.mark.parametrize("options", [dict(shift_labels=True), dict(shift_labels=False),
                                     dict(loss_scaling="sample"), dict(lengths=LENGTHS, shift_labels=True)])
def test_an_explicit_choice_is_not_warned_about(options, recwarn):
    for batch in loader(pad_collate, **options):
        info = odb.pop_step_info(batch)
        if options.get("shift_labels"):  # and the count is the causal LM's
            assert info.local_loss_tokens == int((batch["labels"][:, 1:] != -100).sum())
    assert not shift_warnings(recwarn.list)


def test_labels_of_another_kind_are_not_warned_about(recwarn):
    def token_classes(samples):
        batch = pad_collate(samples)
        batch["labels"] = torch.where(batch["labels"] == -100, -100, batch["labels"] % 3)  # classes, not the ids
        return batch

    for batch in loader(token_classes):
        odb.pop_step_info(batch)
    assert not shift_warnings(recwarn.list)


def test_labels_made_by_the_collator_name_loss_tokens_fn(recwarn):
    """Samples without labels: shift_labels=True alone still counts every input token; the warning says so."""
    unlabeled = [{k: v for k, v in s.items() if k != "labels"} for s in LengthDataset(LENGTHS)]
    for batch in odb.ODBDataLoader(unlabeled, token_budget=BUDGET, buffer_size=16, collate_fn=make_labels,
                                   shift_labels=True):
        odb.pop_step_info(batch)
    [warning] = shift_warnings(recwarn.list)
    assert "the samples carry no 'labels' of their own" in str(warning.message)
    assert "loss_tokens_fn=lambda s: len(s['input_ids']) - 1" in str(warning.message)
    recwarn.clear()
    for batch in odb.ODBDataLoader(unlabeled, token_budget=BUDGET, buffer_size=16, collate_fn=make_labels,
                                   shift_labels=True, loss_tokens_fn=lambda s: len(s["input_ids"]) - 1):
        info = odb.pop_step_info(batch)
        assert info.local_loss_tokens == int((batch["labels"][:, 1:] != -100).sum())  # the fix is exact
    assert not shift_warnings(recwarn.list)


def test_a_reattached_info_is_looked_for_in_the_batch_the_loop_got_and_its_record_is_released():
    """An integration pops the info and attaches it to a device copy: the check follows the copy, and
    keeps no record of it once checked (a device batch must not outlive its step)."""
    import warnings

    from odb.step_info import (ODBStepInfo, StepInfoNotPoppedWarning, UnpoppedCheck, _carriers, attach_step_info,
                               pop_step_info)

    def step(check: UnpoppedCheck, pop: bool, by_hand: bool = False) -> None:
        info = ODBStepInfo(0, 0, 1, 1, 1, 1, 1, 1, 1.0, False)
        batch = attach_step_info({"x": 1}, info)
        check.handed_out(batch, info)
        copy = attach_step_info(dict(batch, x=2), pop_step_info(batch))  # the integration's device copy
        if pop:
            pop_step_info(copy)
        elif by_hand:
            copy.pop("odb_step_info")

    for pop, by_hand, warns in ((True, False, False), (False, True, False), (False, False, True)):
        check = UnpoppedCheck()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for _ in range(3):
                step(check, pop, by_hand)
            check.finished()
        assert [issubclass(w.category, StepInfoNotPoppedWarning) for w in seen] == ([True] if warns else [])
        assert _carriers == {}


@pytest.mark.parametrize("options", [{"gradient_accumulation_steps": 3}, {"global_batch_size": 8}])
def test_optimizer_step_counts_optimizer_steps_and_resumes(options):
    """``optimizer_step`` is the optimizer step's index in the epoch: the same for all its micro-batches, one more
    after each last micro-batch; a resume inside a step continues the count. ``step`` is ``micro_batch``'s
    deprecated name."""
    from roundtrip import read, round_trip

    def record(batch, info):
        return info.optimizer_step, info.micro_step, info.micro_steps

    make = lambda: loader(pad_collate, shuffle=True, seed=2, **options)  # noqa: E731
    got = read(make(), record=record)
    expected, k = [], 0
    for opt, j, m in got:
        expected.append((k, j, m))
        k += j == m - 1
    assert got == expected and k >= 3
    stop = next(i for i, (_, j, m) in enumerate(got) if 0 < j < m)  # inside an optimizer step
    assert round_trip(make, stop, record=record).epoch == got
    info = odb.pop_step_info(next(iter(make())))
    with pytest.warns(DeprecationWarning, match="micro_batch"):
        assert info.step == info.micro_batch == 0
