"""ODBDataLoader as a DataLoader: datasets, workers, seeds, epochs, options and bad input."""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, SequentialSampler, SubsetRandomSampler

import odb
from helpers import (LengthDataset, PadCollate, StreamDataset, epoch, flat_ids, ids_of, known_lengths,
                     pad_collate, tag_worker)

N = 120
LENGTHS = known_lengths(N)
BUDGET = 128


def make(dataset=None, **kwargs):
    options = dict(token_budget=BUDGET, buffer_size=32, collate_fn=pad_collate)
    options.update(kwargs)
    return odb.ODBDataLoader(LengthDataset(LENGTHS) if dataset is None else dataset, **options)


def check_budget(batches, budget=BUDGET):
    for b in batches:
        rows, width = b["input_ids"].shape
        assert b["info"].padded_tokens == rows * width <= budget
        assert b["info"].sample_ids == tuple(b["idx"])


def test_is_a_dataloader():
    loader = make()
    assert isinstance(loader, DataLoader)
    assert loader.batch_size == 1 and loader.num_workers == 0


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
def test_map_style_every_sample_once_within_budget(num_workers, shuffle):
    batches = epoch(make(num_workers=num_workers, shuffle=shuffle, seed=0))
    assert flat_ids(batches) == list(range(N))
    assert len(batches) < N  # samples were actually grouped
    check_budget(batches)


@pytest.mark.parametrize("shard,num_workers", [(False, 0), (True, 0), (True, 2)])
def test_iterable_every_sample_once_within_budget(shard, num_workers):
    batches = epoch(make(StreamDataset(LENGTHS, shard=shard), num_workers=num_workers))
    assert flat_ids(batches) == list(range(N))
    if num_workers:
        assert {p for b in batches for p in b["pid"]} - {os.getpid()}
    for b in batches:  # iterable samples are numbered by arrival
        assert all(0 <= i < N for i in b["info"].sample_ids)
        rows, width = b["input_ids"].shape
        assert b["info"].padded_tokens == rows * width <= BUDGET


def test_same_batches_for_zero_and_two_workers():
    assert ids_of(epoch(make(shuffle=True, seed=3, num_workers=0))) == \
        ids_of(epoch(make(shuffle=True, seed=3, num_workers=2)))


def test_seed_and_generator_reproduce_and_differ():
    by_seed = ids_of(epoch(make(shuffle=True, seed=5)))
    assert ids_of(epoch(make(shuffle=True, seed=5))) == by_seed
    by_gen = ids_of(epoch(make(shuffle=True, generator=torch.Generator().manual_seed(11))))
    assert ids_of(epoch(make(shuffle=True, generator=torch.Generator().manual_seed(11)))) == by_gen
    assert ids_of(epoch(make(shuffle=True, seed=6))) != by_seed
    assert ids_of(epoch(make(shuffle=True, generator=torch.Generator().manual_seed(12)))) != by_gen


def test_without_shuffle_order_is_deterministic():
    loader = make(shuffle=False)
    first, second = ids_of(epoch(loader)), ids_of(epoch(loader))
    assert first == second == ids_of(epoch(make(shuffle=False)))
    assert isinstance(loader.sampler, SequentialSampler)
    assert 0 in first[0]  # batches of a window leave in arrival order
    assert first != ids_of(epoch(make(shuffle=True, seed=0)))


def test_shuffle_epochs_differ_and_set_epoch_reproduces():
    loader = make(shuffle=True, seed=7)
    epochs = [ids_of(epoch(loader)) for _ in range(2)]
    assert epochs[0] != epochs[1]
    loader.set_epoch(1)
    assert ids_of(epoch(loader)) == epochs[1]
    loader.set_epoch(0)
    assert ids_of(epoch(loader)) == epochs[0]


def test_persistent_workers_three_epochs():
    loader = make(shuffle=True, seed=2, num_workers=2, persistent_workers=True)
    epochs, pids = [], []
    for _ in range(3):
        batches = epoch(loader)
        assert flat_ids(batches) == list(range(N))
        epochs.append(ids_of(batches))
        pids.append({p for b in batches for p in b["pid"]})
        if len(epochs) == 1:
            inner = loader.odb_core.inner_loader
            assert inner is not None
    assert loader.odb_core.inner_loader is inner  # the inner loader, and so its workers, persisted
    assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 2 and os.getpid() not in pids[0]
    assert len({repr(e) for e in epochs}) == 3
    loader.set_epoch(1)
    assert ids_of(epoch(loader)) == epochs[1]


def test_worker_init_fn_runs_in_workers():
    batches = epoch(make(num_workers=2, worker_init_fn=tag_worker))
    assert {t for b in batches for t in b["tag"]} == {1000, 1001}
    assert flat_ids(batches) == list(range(N))


def test_spawn_context():
    batches = epoch(make(num_workers=1, multiprocessing_context="spawn", worker_init_fn=tag_worker,
                         collate_fn=PadCollate(4), pad_to_multiple_of=4, shuffle=True, seed=1))
    assert flat_ids(batches) == list(range(N))
    assert {t for b in batches for t in b["tag"]} == {1000}
    assert os.getpid() not in {p for b in batches for p in b["pid"]}
    assert all(b["input_ids"].shape[1] % 4 == 0 for b in batches)


def test_prefetch_factor_passes_through():
    loader = make(num_workers=2, prefetch_factor=3, persistent_workers=True)
    assert flat_ids(epoch(loader)) == list(range(N))
    assert loader.prefetch_factor == 3 and loader.odb_core.inner_loader.prefetch_factor == 3
    with pytest.raises(ValueError, match="prefetch_factor"):  # torch's own rule still applies
        make(num_workers=0, prefetch_factor=3)


def test_pin_memory_without_cuda():
    batches = epoch(make(pin_memory=True))
    assert flat_ids(batches) == list(range(N))
    assert all(isinstance(b["input_ids"], torch.Tensor) for b in batches)
    if torch.cuda.is_available():
        assert all(b["input_ids"].is_pinned() and b["labels"].is_pinned() for b in batches)


def test_drop_last_drops_only_final_underfilled_groups():
    # max_carry=0: every window of 3 samples (cost 30 < budget / 2) becomes one batch;
    # only the final window's 2-sample group is dropped.
    options = dict(token_budget=100, buffer_size=3, max_carry=0)
    loader = make(LengthDataset([10] * 23), drop_last=True, **options)
    batches = epoch(loader)
    assert [len(b["idx"]) for b in batches] == [3] * 7
    assert flat_ids(batches) == list(range(21))
    assert loader.odb_stats["dropped_samples"] == 2
    keep = make(LengthDataset([10] * 23), drop_last=False, **options)
    assert flat_ids(epoch(keep)) == list(range(23)) and keep.odb_stats["dropped_samples"] == 0


def test_drop_last_counts_every_dropped_sample():
    loader = make(LengthDataset([10] * 23), drop_last=True, token_budget=100, buffer_size=23)
    batches = epoch(loader)
    assert all(b["info"].padded_tokens >= 50 for b in batches)
    assert len(flat_ids(batches)) + loader.odb_stats["dropped_samples"] == 23
    assert loader.odb_stats["dropped_samples"] == 3


def test_len_is_an_estimate_then_exact():
    loader = make(shuffle=True, seed=0)
    estimate = len(loader)
    batches = epoch(loader)
    assert len(loader) == len(batches)
    # Counted by hand: no batch holds more than BUDGET tokens, so at least ceil(2,504 / 128) = 20 steps; the
    # epoch ran 24 (seeds 0-5 alike), and the estimate before it (all 120 lengths read, odb's planning simulated
    # on another shuffle) was 24 too. One step of slack for the shuffle.
    assert sum(LENGTHS) == 2504 and len(batches) >= 20
    assert abs(estimate - len(batches)) <= 1, (estimate, len(batches))


def test_len_of_iterable_needs_one_epoch():
    loader = make(StreamDataset(LENGTHS))
    with pytest.raises(TypeError, match="Fix"):
        len(loader)
    batches = epoch(loader)
    assert flat_ids(batches) == list(range(N)) and len(loader) == len(batches)


def test_lengths_hint_drives_the_estimate():
    # The hint says every sample fills the budget alone: one batch per sample.
    assert len(make(lengths=[BUDGET] * N)) == N
    assert len(make()) < N


def test_user_sampler_is_honoured():
    subset = list(range(0, N, 3))
    sampler = SubsetRandomSampler(subset, generator=torch.Generator().manual_seed(0))
    assert flat_ids(epoch(make(sampler=sampler))) == subset


def oversize_data():
    lengths = list(LENGTHS)
    lengths[7] = BUDGET + 5
    return LengthDataset(lengths)


def test_oversize_error_names_sample_and_length():
    with pytest.raises(ValueError, match=rf"sample 7 has length {BUDGET + 5}.*Fix"):
        epoch(make(oversize_data()))


def test_oversize_alone_gets_its_own_batch():
    loader = make(oversize_data(), oversize="alone")
    batches = epoch(loader)
    assert flat_ids(batches) == list(range(N))
    assert [b["idx"] for b in batches if 7 in b["idx"]] == [[7]]
    assert loader.odb_stats["oversize_alone"] == 1


def test_oversize_skip_warns_and_counts():
    loader = make(oversize_data(), oversize="skip")
    with pytest.warns(UserWarning, match="skipped 1"):
        batches = epoch(loader)
    assert flat_ids(batches) == [i for i in range(N) if i != 7]
    assert loader.odb_stats["oversize_skipped"] == 1


def test_max_batch_size_caps_batches():
    batches = epoch(make(LengthDataset(known_lengths(N, 1, 8)), max_batch_size=5))
    sizes = [len(b["idx"]) for b in batches]
    assert max(sizes) == 5 and flat_ids(batches) == list(range(N))


def test_batch_size_multiple():
    batches = epoch(make(LengthDataset(known_lengths(N, 1, 8)), batch_size_multiple=4))
    assert all(len(b["idx"]) % 4 == 0 for b in batches)
    assert flat_ids(batches) == list(range(N))


def test_pad_to_multiple_of():
    batches = epoch(make(pad_to_multiple_of=8, collate_fn=PadCollate(8)))
    check_budget(batches)
    for b in batches:
        longest = max(LENGTHS[i] for i in b["idx"])
        assert b["info"].padded_tokens == len(b["idx"]) * -(-longest // 8) * 8


def test_custom_length_fn():
    batches = epoch(make(length_fn=lambda s: 2 * len(s["input_ids"])))
    assert flat_ids(batches) == list(range(N))
    for b in batches:
        rows, width = b["input_ids"].shape
        assert b["info"].padded_tokens == 2 * rows * width <= BUDGET
        assert b["info"].real_tokens == 2 * sum(LENGTHS[i] for i in b["idx"])


def test_seq2seq_lengths_with_budget_per_dimension():
    src = known_lengths(N, 1, 20, seed=1)
    tgt = known_lengths(N, 1, 30, seed=2)
    data = LengthDataset(src, extra={"labels": [torch.ones(t, dtype=torch.long) for t in tgt]})
    batches = [odb.pop_step_info(b) for b in make(data, token_budget=(64, 96), length_fn=odb.seq2seq_lengths,
                                                  collate_fn=list)]
    assert sorted(i for info in batches for i in info.sample_ids) == list(range(N))
    for info in batches:
        rows = len(info.sample_ids)
        s, t = max(src[i] for i in info.sample_ids), max(tgt[i] for i in info.sample_ids)
        assert rows * s <= 64 and rows * t <= 96
        assert info.padded_tokens == rows * (s + t)


def test_image_patch_cap():
    patches = known_lengths(N, 0, 12, seed=3)
    data = LengthDataset(LENGTHS, extra={"patches": patches})
    batches = epoch(make(data, image_patches_key="patches", max_image_patches=20))
    assert flat_ids(batches) == list(range(N))
    assert max(sum(patches[i] for i in b["idx"]) for b in batches) <= 20
    assert any(len(b["idx"]) > 1 for b in batches)


def test_image_patch_cost_plans_text_and_vision_under_one_budget():
    # each patch weighs a quarter token: a batch's padded tokens plus its patches / 4 stay within the budget,
    # the patch cap stays hard, and image-heavy batches hold fewer samples than the cap alone gives
    patches = known_lengths(N, 0, 200, seed=3)
    data = LengthDataset(LENGTHS, extra={"patches": patches})
    priced = epoch(make(data, image_patches_key="patches", max_image_patches=400, image_patch_cost=0.25))
    capped = epoch(make(data, image_patches_key="patches", max_image_patches=400))
    assert flat_ids(priced) == list(range(N))
    for b in priced:
        tokens = len(b["idx"]) * max(LENGTHS[i] for i in b["idx"])
        assert tokens + 0.25 * sum(patches[i] for i in b["idx"]) <= BUDGET
        assert sum(patches[i] for i in b["idx"]) <= 400
    assert len(priced) > len(capped)


BAD_INPUTS = [
    ("batch_size", dict(batch_size=0), False, ValueError, "batch_size=0"),  # batch_size=8 is the user's batch
    ("batch_sampler", dict(batch_sampler=BatchSampler(SequentialSampler(range(N)), 2, False)), False,
     ValueError, "batch_sampler=<torch.utils.data.sampler.BatchSampler"),
    ("iterable_sampler", dict(dataset=StreamDataset(LENGTHS), sampler=SequentialSampler(range(N))), False,
     ValueError, "sampler=<torch.utils.data.sampler.SequentialSampler"),
    ("no_budget", dict(token_budget=None), False, TypeError, "token_budget"),
    ("unknown_option", dict(bogus_knob=3), False, TypeError, "bogus_knob"),
    ("garbage_length", dict(length_fn=lambda s: "garbage"), True, ValueError, "'garbage'"),
    ("none_length", dict(length_fn=lambda s: None), True, ValueError, "returned None"),
    ("digit_string_length", dict(length_fn=lambda s: "12"), True, ValueError, "'12'"),
    ("float_length", dict(length_fn=lambda s: 3.5), True, ValueError, "returned 3.5"),
    ("negative_length", dict(length_fn=lambda s: -4), True, ValueError, "returned -4"),
]


@pytest.mark.parametrize("name,kwargs,iterate,error,names", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_with_a_fix(name, kwargs, iterate, error, names):
    kwargs = dict(kwargs)
    dataset = kwargs.pop("dataset", None)
    with pytest.raises(error) as caught:
        loader = make(dataset, **kwargs)
        if iterate:
            next(iter(loader))
    assert names in str(caught.value) and "Fix" in str(caught.value)


class CountingDataset(LengthDataset):
    """A LengthDataset that counts its reads (in this process: num_workers=0)."""

    def __init__(self, lengths):
        super().__init__(lengths)
        self.reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_len_with_a_shuffling_sampler_reads_no_sample_twice():
    # len() estimates from the epoch's first samples (a uniform sample when the order is shuffled) and keeps
    # them for the epoch: the whole epoch then reads every sample exactly once, len() included.
    data = CountingDataset(known_lengths(2000, 1, 200))
    loader = make(data, shuffle=True, seed=0, token_budget=1024, buffer_size=256)
    estimate = len(loader)
    assert 0 < data.reads < 2000  # the first window, read now
    batches = epoch(loader)
    assert data.reads == 2000 and sorted(flat_ids(batches)) == list(range(2000))
    assert abs(estimate / len(batches) - 1) <= 0.10
    fresh = make(CountingDataset(known_lengths(2000, 1, 200)), shuffle=True, seed=0, token_budget=1024,
                 buffer_size=256)
    assert ids_of(epoch(fresh)) == ids_of(batches)  # len() first or not: the same batches


@pytest.mark.parametrize("num_workers", [0, 2])
def test_len_before_each_epoch_keeps_batches_and_order(num_workers):
    plain = make(shuffle=True, seed=3, num_workers=num_workers)
    asked = make(shuffle=True, seed=3, num_workers=num_workers)
    for e in range(2):
        plain.set_epoch(e)
        asked.set_epoch(e)
        len(asked)
        assert ids_of(epoch(asked)) == ids_of(epoch(plain))


def test_len_then_another_epoch_reads_that_epochs_order():
    # len() read epoch 0's first window; set_epoch(1) before iterating drops it and reads epoch 1's.
    data = CountingDataset(LENGTHS)
    loader = make(data, shuffle=True, seed=5)
    len(loader)
    loader.set_epoch(1)
    reference = make(shuffle=True, seed=5)
    reference.set_epoch(1)
    assert ids_of(epoch(loader)) == ids_of(epoch(reference))


def test_len_with_sequential_order_probes_the_dataset():
    data = CountingDataset(LENGTHS)
    loader = make(data)  # sequential order: its first samples are no sample of the data
    len(loader)
    probed = data.reads
    assert probed > 0
    epoch(loader)
    assert data.reads == probed + N  # the probe is a separate pass
