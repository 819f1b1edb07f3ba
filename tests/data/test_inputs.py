"""What users feed odb: sample lengths, collators, encoder-decoder targets and arguments.

Each case is a mistake seen in real use; odb must either do the right thing or refuse
with a message that names the value, the rule and the fix.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler

import odb
from helpers import LengthDataset, known_lengths, pad_collate
from odb.data.collate_check import RaggedBatchError
from odb.data.lengths import SampleLengthError


def ids_of(loader) -> list:
    return [list(odb.pop_step_info(b).sample_ids) for b in loader]


def squeeze_collate(samples):
    """Pads samples whose input_ids are (1, L) rows."""
    return pad_collate([{**s, "input_ids": s["input_ids"][0], "labels": s["input_ids"][0]} for s in samples])


class RowDataset(torch.utils.data.Dataset):
    """Samples as tokenizer(text, return_tensors="pt") gives them: input_ids of shape (1, L)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, i):
        return {"input_ids": torch.arange(self.lengths[i]).reshape(1, -1) % 50, "idx": i, "pid": 0, "tag": None}


# ---- lengths -----------------------------------------------------------------------------------


def test_one_row_tensors_count_their_tokens():
    assert odb.default_length({"input_ids": torch.ones(1, 7)}) == 7
    assert odb.default_length({"input_ids": [[1, 2, 3]]}) == 3
    lengths = known_lengths(40, 5, 30, seed=3)
    loader = odb.ODBDataLoader(RowDataset(lengths), token_budget=64, buffer_size=40, collate_fn=squeeze_collate)
    for batch in loader:
        info = odb.pop_step_info(batch)
        assert info.padded_tokens == batch["input_ids"].numel() <= 64  # counted as 1 token, B would be 64
        assert info.real_tokens == sum(lengths[i] for i in info.sample_ids)


@pytest.mark.parametrize("sample,words", [
    ({"pixel_values": torch.ones(3, 32, 32)}, ["'pixel_values' of shape (3, 32, 32)", "image patches"]),
    ({"input_features": torch.ones(80, 300)}, ["'input_features' of shape (80, 300)", "mel bins", "frames"]),
    ({"input_ids": torch.ones(2, 7)}, ["shape (2, 7)", "2 rows", "return_tensors='pt'"]),
    ({"input_ids": [[1, 2], [3]]}, ["list of 2 sequences"]),
    ("a raw sentence", ["raw text", "tokenize in the dataset"]),
    (("a raw sentence", 1), ["first field is raw text", "tokenize in the dataset"]),
    ({"text": "hi"}, ["fields ['text']", "tokenize in the dataset"]),
])
def test_samples_without_a_token_length_are_refused(sample, words):
    with pytest.raises(SampleLengthError) as err:
        odb.default_length(sample)
    for word in words + ["length_fn"]:
        assert word in str(err.value)


@pytest.mark.parametrize("workers", [0, 1])
def test_raw_strings_stop_the_loader_with_the_fix(workers):
    texts = ["short", "a somewhat longer sentence", "mid length text"] * 4
    loader = odb.ODBDataLoader(texts, token_budget=100_000, collate_fn=list, num_workers=workers)
    with pytest.raises(SampleLengthError, match=r"raw text \('short'\).*tokenize in the dataset, or pass length_fn"):
        next(iter(loader))


def test_image_samples_stop_the_loader_unless_length_fn_is_given():
    images = [{"pixel_values": torch.ones(3, 4 * k, 4)} for k in (1, 2, 3, 4)]
    with pytest.raises(SampleLengthError, match="pixel_values"):
        next(iter(odb.ODBDataLoader(images, token_budget=64, collate_fn=list)))
    patches = odb.ODBDataLoader(images, token_budget=10, collate_fn=list, buffer_size=4,
                                length_fn=lambda s: s["pixel_values"].shape[1] // 4)
    groups = ids_of(patches)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert all(len(g) * (max(g) + 1) <= 10 for g in groups)  # sample k has k + 1 patches


# ---- collate -----------------------------------------------------------------------------------


def ragged(n: int = 12):
    return [{"input_ids": torch.ones(k, dtype=torch.long)} for k in known_lengths(n, 2, 9, seed=1)]


@pytest.mark.parametrize("collate", ["none", "hf_default"])
def test_stacking_collate_names_a_padding_collator(collate):
    fn = None
    if collate == "hf_default":
        from transformers import default_data_collator as fn
    loader = odb.ODBDataLoader(ragged(), token_budget=64, buffer_size=12, collate_fn=fn)
    with pytest.raises(RaggedBatchError, match=r"samples of \d+ to \d+ tokens.*collate_fn=(default_collate|"
                                               r"default_data_collator).*DataCollatorForSeq2Seq") as err:
        next(iter(loader))
    assert "equal size" in str(err.value.__cause__) or "stack expects" in str(err.value.__cause__)


def test_known_lengths_mode_names_a_padding_collator_too():
    data = ragged()
    loader = odb.ODBDataLoader(data, token_budget=64, buffer_size=12, lengths=[len(s["input_ids"]) for s in data])
    with pytest.raises(RaggedBatchError, match="DataCollatorForSeq2Seq"):
        next(iter(loader))


def test_equal_lengths_and_other_errors_pass_through():
    same = [{"input_ids": torch.ones(4, dtype=torch.long)} for _ in range(8)]
    batch = next(iter(odb.ODBDataLoader(same, token_budget=16, buffer_size=8)))  # default_collate stacks them
    assert batch["input_ids"].shape == (4, 4)

    def broken(samples):
        raise RuntimeError("my collate is broken")

    with pytest.raises(RuntimeError, match="^my collate is broken$"):
        next(iter(odb.ODBDataLoader(ragged(), token_budget=64, collate_fn=broken)))


# ---- encoder-decoder targets -------------------------------------------------------------------


def pairs(n: int = 24):
    src, tgt = known_lengths(n, 2, 10, seed=1), known_lengths(n, 20, 40, seed=2)
    return [{"input_ids": torch.ones(s, dtype=torch.long), "labels": torch.ones(t, dtype=torch.long)}
            for s, t in zip(src, tgt)]


def test_unbudgeted_targets_are_warned_about_once():
    loader = odb.ODBDataLoader(pairs(), token_budget=64, buffer_size=8, collate_fn=list)
    with pytest.warns(UserWarning, match=r"sample \d+ has \d+ input_ids but \d+ 'labels'.*odb.seq2seq_lengths") as seen:
        for epoch in range(2):
            loader.set_epoch(epoch)
            list(loader)
    assert len([w for w in seen if "seq2seq_lengths" in str(w.message)]) == 1


@pytest.mark.parametrize("case", ["causal", "length_fn"])
def test_no_warning_when_targets_are_budgeted(case):
    if case == "causal":  # labels line up with input_ids
        loader = odb.ODBDataLoader(LengthDataset(known_lengths(16)), token_budget=64, collate_fn=list)
    else:
        loader = odb.ODBDataLoader(pairs(), token_budget=128, collate_fn=list, length_fn=odb.seq2seq_lengths)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(loader)


def test_tuple_budget_without_length_fn_points_at_seq2seq_lengths():
    with pytest.raises(ValueError, match=r"token_budget=\(64, 64\).*length_fn=odb.seq2seq_lengths"):
        odb.ODBDataLoader(pairs(), token_budget=(64, 64), collate_fn=list)
    with pytest.raises(ValueError, match="length_fn=odb.seq2seq_lengths"):
        odb.apply(DataLoader(pairs(), batch_size=1, collate_fn=list), token_budget=(64, 64))
    known = [odb.seq2seq_lengths(s) for s in pairs()]  # per-sample lengths given: nothing to measure
    assert len(ids_of(odb.ODBDataLoader(pairs(), token_budget=(64, 128), collate_fn=list, lengths=known))) > 1


def test_seq2seq_lengths_names_the_fields_it_reads():
    assert odb.seq2seq_lengths({"input_ids": torch.ones(1, 5), "labels": [1, 2, 3]}) == (5, 3)
    with pytest.raises(SampleLengthError, match=r"got a sample with \['input_ids'\]: it reads 'input_ids' "
                                                r"\(source\) and 'labels' \(target\).*length_fn"):
        odb.seq2seq_lengths({"input_ids": [1, 2]})


# ---- arguments ---------------------------------------------------------------------------------


@pytest.mark.parametrize("make,match", [
    (lambda: odb.ODBConfig(token_budget=64, max_batchsize=4),
     r"^ODBConfig got an unknown option max_batchsize=4 \(did you mean max_batch_size\?\)"),
    (lambda: odb.ODBConfig(token_budget=64).replace(buffer_sise=8), r"buffer_sise=8 \(did you mean buffer_size\?\)"),
    (lambda: odb.ODBDataLoader(ragged(), token_budget=64, max_batchsize=4), r"^ODBDataLoader got .*max_batch_size\?"),
    (lambda: odb.ODBDataLoader(ragged(), token_budget=64, num_worker=2), r"did you mean num_workers\?"),
    (lambda: odb.apply(DataLoader(ragged(), batch_size=1), token_budget=64, pad_to_multiple=8),
     r"^odb.apply got .*did you mean pad_to_multiple_of\?"),
])
def test_unknown_options_suggest_the_closest_name(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_unknown_option_without_a_close_name():
    with pytest.raises(TypeError) as err:
        odb.ODBConfig(token_budget=64, zzz=1)
    assert "zzz=1. Rule" in str(err.value) and "did you mean" not in str(err.value)


def test_batch_size_options_get_the_batch_size_rule():
    with pytest.raises(ValueError, match=r"^ODBConfig got batch_size=8: odb reads your batch where you set it "
                                         r".*Fix: drop batch_size here and set your batch there"):
        odb.ODBConfig(token_budget=64, batch_size=8)
    with pytest.raises(ValueError, match=r"^odb.apply got batch_size=8: .*max_batch_size=N"):
        odb.apply(DataLoader(ragged(), batch_size=1), token_budget=64, batch_size=8)


def test_shuffle_with_a_sampler_is_refused():
    data = ragged()
    with pytest.raises(ValueError, match=r"shuffle=True with sampler=SequentialSampler.*Fix: drop shuffle"):
        odb.ODBDataLoader(data, token_budget=64, shuffle=True, sampler=SequentialSampler(data))


def first_positions(loader, order):
    position = {index: k for k, index in enumerate(order)}
    return [min(position[i] for i in ids) for ids in ids_of(loader)]


def test_batch_order_follows_the_samplers_shuffle():
    data = LengthDataset(known_lengths(120, 1, 20, seed=2))
    one_window = dict(token_budget=40, buffer_size=120, first_window_size=120, window_budgets=None,
                      collate_fn=pad_collate, seed=0)
    plain = odb.ODBDataLoader(data, sampler=SequentialSampler(data), **one_window)
    firsts = first_positions(plain, range(120))
    assert len(firsts) > 10 and firsts == sorted(firsts)  # a sampler that does not shuffle: arrival order
    sampler = odb.ShardSampler(data, num_replicas=1, rank=0, shuffle=True, seed=1)
    shuffled = odb.ODBDataLoader(data, sampler=sampler, **one_window)
    firsts = first_positions(shuffled, list(sampler))
    assert firsts != sorted(firsts)  # a shuffling sampler: the batch order is shuffled too
    kept = odb.ODBDataLoader(data, sampler=sampler, shuffle=False, **one_window)
    firsts = first_positions(kept, list(sampler))
    assert firsts == sorted(firsts)


def test_a_seeded_sampler_makes_the_batch_order_repeat():
    # No odb seed: it comes from the sampler's, so two runs (or a resumed one) order batches alike.
    data = LengthDataset(known_lengths(120, 1, 20, seed=2))
    runs = [ids_of(odb.ODBDataLoader(data, sampler=odb.ShardSampler(data, 1, 0, shuffle=True, seed=5),
                                     token_budget=40, collate_fn=pad_collate)) for _ in range(2)]
    assert runs[0] == runs[1]
    other = ids_of(odb.ODBDataLoader(data, sampler=odb.ShardSampler(data, 1, 0, shuffle=True, seed=5),
                                     token_budget=40, collate_fn=pad_collate, seed=9))
    assert other != runs[0]  # an odb seed of its own orders them otherwise


def test_in_order_false_is_refused_before_anything_changes():
    data = ragged()
    with pytest.raises(ValueError, match=r"in_order=False.*depend on worker timing.*Fix: leave in_order=True"):
        odb.ODBDataLoader(data, token_budget=64, in_order=False)
    loader = DataLoader(data, batch_size=1, sampler=RandomSampler(data), in_order=False)
    with pytest.raises(ValueError, match="in_order=False"):
        odb.apply(loader, token_budget=64)
    assert type(loader) is DataLoader  # not half converted
    assert len(ids_of(odb.ODBDataLoader(data, token_budget=64, in_order=True, collate_fn=list))) > 1


# ---- the HF Trainer ----------------------------------------------------------------------------


@pytest.fixture
def hf():
    import hf_workers
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, Trainer, TrainingArguments

    return dict(W=hf_workers, Seq2SeqTrainer=Seq2SeqTrainer, Seq2SeqTrainingArguments=Seq2SeqTrainingArguments,
                Trainer=Trainer, TrainingArguments=TrainingArguments)


def hf_trainer(hf, tmp_path, model="llama", **args):
    W = hf["W"]
    if model == "t5":
        targs = hf["Seq2SeqTrainingArguments"](str(tmp_path), use_cpu=True, report_to="none", save_strategy="no",
                                               **args)
        return hf["Seq2SeqTrainer"](model=W.t5(), args=targs, train_dataset=W.seq2seq_dataset(24),
                                    data_collator=W.pad_collate)
    targs = hf["TrainingArguments"](str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", **args)
    return hf["Trainer"](model=W.llama(), args=targs, train_dataset=W.causal_dataset(24), data_collator=W.pad_collate)


def test_enable_odb_arguments(hf, tmp_path):
    from odb.integrations.hf import configure_trainer, enable_odb

    with pytest.raises(ValueError, match=r"^enable_odb got batch_size=8: odb reads your batch where you set it "
                                         r".*per_device_train_batch_size"):
        enable_odb(hf_trainer(hf, tmp_path), token_budget=64, batch_size=8)
    with pytest.raises(TypeError, match=r"^enable_odb got an unknown option max_batchsize=4 \(did you mean "
                                        r"max_batch_size\?\)"):
        enable_odb(hf_trainer(hf, tmp_path), token_budget=64, max_batchsize=4)
    if hasattr(hf["TrainingArguments"], "dataloader_in_order"):  # newer than transformers 5.5.4
        with pytest.raises(ValueError, match=r"dataloader_in_order=False.*fix: True"):
            enable_odb(hf_trainer(hf, tmp_path, dataloader_in_order=False), token_budget=64)
        fixed = hf_trainer(hf, tmp_path, dataloader_in_order=False)
        fixed.args = configure_trainer(fixed.args)  # the fix the message names
        assert enable_odb(fixed, token_budget=64).args.dataloader_in_order is True
    with pytest.raises(ValueError, match=r"token_budget=\(64, 32\).*length_fn=odb.seq2seq_lengths"):
        enable_odb(hf_trainer(hf, tmp_path), token_budget=(64, 32))


def test_encoder_decoder_models_budget_source_and_target(hf, tmp_path):
    from odb.integrations.hf import enable_odb

    causal = enable_odb(hf_trainer(hf, tmp_path), token_budget=64)
    assert causal.odb_config.length_fn is None
    trainer = enable_odb(hf_trainer(hf, tmp_path, "t5"), token_budget=48)
    assert trainer.odb_config.length_fn is odb.seq2seq_lengths
    seen = 0
    for batch in trainer.get_train_dataloader():
        info = odb.pop_step_info(batch)
        assert batch["input_ids"].numel() + batch["labels"].numel() == info.padded_tokens <= 48
        seen += info.local_samples
    assert seen == 24
    chosen = enable_odb(hf_trainer(hf, tmp_path, "t5"), token_budget=48, length_fn=odb.default_length)
    assert chosen.odb_config.length_fn is odb.default_length  # the user's choice stays
    given = enable_odb(hf_trainer(hf, tmp_path, "t5"), token_budget=48, lengths=np.full(24, 10))
    assert given.odb_config.length_fn is None  # known lengths: nothing to measure
