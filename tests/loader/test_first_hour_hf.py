"""A new user's first hour with odb and the HF Trainer: the traps of issue 19, each caught or gone.

- transformers' standard collators (DataCollatorForLanguageModeling causal and masked,
  DataCollatorWithPadding, DataCollatorForSeq2Seq, DataCollatorWithFlattening) train with
  the exact token-mean loss and no extra argument, in the real Trainer (one optimizer
  step against a float64 single-process reference over the same samples);
- a collator odb does not know: the error says what odb saw and what it assumed;
- a sample longer than the budget is refused when the trainer is configured (known
  lengths), and by ``len(loader)`` (probed lengths), not at some later step;
- samples of one length (nothing to group) are named once per loader;
- the Trainer's train-start banner says that odb sizes the batches by the token budget (its
  'Instantaneous batch size per device' line no longer prints the unused per_device_train_batch_size).

Models are tiny float64 Llama / BERT built from configs, the tokenizer is trained
offline (examples/_hf_text.py).
"""

from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F

import datasets  # pinned under `make test` and test-min: a broken install fails, never skips
import hf_workers as W
from transformers import Trainer, TrainingArguments

import odb
from odb.integrations.hf import collator_options, enable_odb

EXACT = 1e-6  # the losses run in float32 inside transformers (logits.float())
IGNORE = -100


def rel_error(delta: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    scale = max(r.abs().max().item() for r in ref.values())
    return max((delta[n] - r).abs().max().item() for n, r in ref.items()) / scale


tokenizer, text_dataset, bert = W.word_tokenizer, W.text_dataset, W.bert


def args(tmp_path: Path, ga: int = 2, **kw: Any) -> TrainingArguments:
    options = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True, optim="sgd",
                   learning_rate=1e-3, weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                   gradient_accumulation_steps=ga, max_steps=1, save_strategy="no", logging_strategy="no", seed=7,
                   dataloader_num_workers=0)
    options.update(kw)
    return TrainingArguments(**options)


def one_step(trainer: Trainer) -> tuple:
    """(parameter change, sample ids, step infos) of one optimizer step."""
    before = {n: w.detach().clone() for n, w in trainer.model.named_parameters()}
    trainer.train()
    delta = {n: w.detach() - before[n] for n, w in trainer.model.named_parameters()}
    infos = trainer.odb_step_infos
    return delta, sorted(i for info in infos for i in info.sample_ids), infos


def causal_reference(model: Any, collator: Any, dataset: Any, ids: List[int], lr: float) -> tuple:
    """-lr x gradient of (sum of token losses) / (their count) over ``ids``, each sample collated alone."""
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for i in ids:
        batch = collator([dataset[int(i)]])
        logits = model(input_ids=batch["input_ids"]).logits[0][:-1]
        labels = batch["labels"][0][1:]
        keep = labels != IGNORE
        total = total + F.cross_entropy(logits[keep].double(), labels[keep], reduction="sum")
        tokens += int(keep.sum())
    (total / tokens).backward()
    return {n: -lr * w.grad for n, w in model.named_parameters() if w.grad is not None}, tokens


# ---- the standard collators train exactly, with no extra argument ------------------------------------


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_causal_lm_collator_trains_exactly(tmp_path, pad_is_eos):
    # Before: ValueError at step 1 ("odb counted N supervised tokens ... but the collated batch holds M").
    from transformers import DataCollatorForLanguageModeling

    tok = tokenizer(pad_is_eos=pad_is_eos)
    data = text_dataset(tok, eos=pad_is_eos)  # pad = eos: the collator masks the eos tokens too
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = enable_odb(Trainer(model=W.llama(), args=args(tmp_path), train_dataset=data, data_collator=collator),
                         token_budget=96, buffer_size=16)
    delta, ids, infos = one_step(trainer)
    per_step = trainer.args.per_device_train_batch_size * trainer.args.gradient_accumulation_steps
    assert len(ids) == per_step and [i.micro_step for i in infos] == list(range(len(infos)))
    ref, tokens = causal_reference(W.llama(), collator, data, ids, 1e-3)
    assert sum(i.local_loss_tokens for i in infos) == tokens
    assert rel_error(delta, ref) < EXACT


def masked_lm_reference(batches: List[Dict[str, torch.Tensor]], lr: float) -> Dict[str, torch.Tensor]:
    """-lr x gradient of (sum of masked-token losses) / (their count) over the collated batches."""
    model = bert("mlm")
    total, count = torch.zeros((), dtype=torch.float64), 0
    for b in batches:
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
        keep = b["labels"] != IGNORE
        total = total + F.cross_entropy(logits[keep].double(), b["labels"][keep], reduction="sum")
        count += int(keep.sum())
    (total / count).backward()
    return {n: -lr * w.grad for n, w in model.named_parameters() if w.grad is not None}


def test_masked_lm_collator_counts_the_masked_tokens_after_collate(tmp_path):
    # The masked tokens are drawn by the collator: odb counts them in the collated batches.
    # Before: ValueError at step 1 (odb counted every input token of the samples).
    r = W.masked_lm_step(0, 1, dict(out=str(tmp_path), n=24, ga=2, lr=1e-3, budget=96))
    counts = [int((b["labels"] != IGNORE).sum()) for b in r["batches"]]
    infos = r["infos"]
    assert [i["local_loss_tokens"] for i in infos] == counts and len(counts) >= 2 and min(counts) > 0
    assert all(i["global_loss_tokens"] == sum(counts) for i in infos)
    assert [i["loss_scale"] for i in infos] == pytest.approx([c / sum(counts) for c in counts])
    assert rel_error(r["delta"], masked_lm_reference(r["batches"], 1e-3)) < EXACT


@pytest.mark.dist
def test_masked_lm_on_two_ranks_weights_by_the_counts_of_both(tmp_path):
    # One all-reduce per optimizer step sums the collated counts of every rank's micro-batches.
    from dist_harness import run_ranks

    ranks = run_ranks("hf_workers:masked_lm_step", 2, dict(out=str(tmp_path / "run"), n=24, ga=2, lr=1e-3,
                                                         budget=96), tmp_path / "h", deadline_s=180)
    real = [b for r in ranks for b, i in zip(r["batches"], r["infos"]) if not i["is_ghost"]]
    total = sum(int((b["labels"] != IGNORE).sum()) for b in real)
    assert len(real) >= 3 and all(i["global_loss_tokens"] == total for r in ranks for i in r["infos"])
    ref = masked_lm_reference(real, 1e-3)
    for rank, r in enumerate(ranks):
        assert rel_error(r["delta"], ref) < EXACT, f"rank {rank}"


def test_padding_collator_counts_one_label_per_sample(tmp_path):
    # Sequence classification: the loss is the mean over samples. Before: ValueError at step 1
    # (odb counted each sample's tokens; the collated batch holds one label per sample).
    from transformers import DataCollatorWithPadding

    tok = tokenizer()
    data = text_dataset(tok, label=True)
    collator = DataCollatorWithPadding(tok)
    trainer = enable_odb(Trainer(model=bert("cls"), args=args(tmp_path), train_dataset=data, data_collator=collator),
                         token_budget=96, buffer_size=16)
    delta, ids, infos = one_step(trainer)
    assert sum(i.local_loss_tokens for i in infos) == len(ids) >= 4
    model = bert("cls")
    losses = [F.cross_entropy(model(input_ids=torch.tensor([data[i]["input_ids"]])).logits.double(),
                              torch.tensor([data[i]["label"]])) for i in ids]
    (torch.stack(losses).sum() / len(ids)).backward()
    ref = {n: -1e-3 * w.grad for n, w in model.named_parameters() if w.grad is not None}
    assert rel_error(delta, ref) < EXACT


def test_seq2seq_collator_pads_within_the_budget(tmp_path):
    # Before: odb planned with pad_to_multiple_of=1 while the collator rounds every batch up to 8.
    from transformers import DataCollatorForSeq2Seq

    tok = tokenizer()
    rows = W.causal_dataset(24)
    data = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                       "labels": [r["labels"].tolist() for r in rows]})
    collator = DataCollatorForSeq2Seq(tok, pad_to_multiple_of=8)
    shapes: List[tuple] = []

    class Shapes(DataCollatorForSeq2Seq):
        def __call__(self, features: Any, return_tensors: Any = None) -> Any:
            batch = super().__call__(features, return_tensors)
            shapes.append(tuple(batch["input_ids"].shape))
            return batch

    collator = Shapes(tok, pad_to_multiple_of=8)
    trainer = enable_odb(Trainer(model=W.llama(), args=args(tmp_path, max_steps=3), train_dataset=data,
                                 data_collator=collator), token_budget=60, buffer_size=16)
    assert trainer.odb_config.pad_to_multiple_of == 8
    delta, ids, infos = one_step(trainer)
    assert shapes and all(rows * width <= 60 and width % 8 == 0 for rows, width in shapes)
    with pytest.raises(ValueError, match=r"label_pad_token_id=0.*Fix: label_pad_token_id=-100"):
        enable_odb(Trainer(model=W.llama(), args=args(tmp_path), train_dataset=data,
                           data_collator=DataCollatorForSeq2Seq(tok, label_pad_token_id=0)), token_budget=60)
    with pytest.raises(ValueError, match=r"padding='max_length'.*Fix: padding=True"):
        enable_odb(Trainer(model=W.llama(), args=args(tmp_path), train_dataset=data,
                           data_collator=DataCollatorForSeq2Seq(tok, padding="max_length", max_length=32)),
                   token_budget=60)


def test_flattening_collator_trains_packed_rows_exactly(tmp_path, caplog):
    # Before: planned as padded batches, and ValueError at step 1 (each sample's first label is masked).
    from transformers import DataCollatorWithFlattening

    tok = tokenizer()
    data = text_dataset(tok)
    collator = DataCollatorWithFlattening()
    with caplog.at_level(logging.WARNING, logger="odb"):
        trainer = enable_odb(Trainer(model=W.llama(), args=args(tmp_path), train_dataset=data,
                                     data_collator=collator), token_budget=96, buffer_size=16)
    assert trainer.odb_config.layout == "packed"
    assert trainer.model.config._attn_implementation == "odb_varlen"  # eager's dense mask replaced
    assert "switched from 'eager' to 'odb_varlen'" in caplog.text and "packed_attention='model'" in caplog.text
    delta, ids, infos = one_step(trainer)
    assert len(ids) >= 4 and all(i.padded_tokens == i.real_tokens <= 96 for i in infos)
    ref, tokens = causal_reference(W.llama(), collator, data, ids, 1e-3)
    assert sum(i.local_loss_tokens for i in infos) == tokens
    assert rel_error(delta, ref) < EXACT


def test_collator_options_for_a_loop_of_your_own():
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithFlattening

    tok = tokenizer()
    data = [{"input_ids": ids} for ids in text_dataset(tok, n=40)["input_ids"]]
    causal = DataCollatorForLanguageModeling(tok, mlm=False)
    loader = odb.ODBDataLoader(data, token_budget=96, buffer_size=16, collate_fn=causal,
                               **collator_options(causal, shift_labels=True))
    for batch in loader:
        info = odb.pop_step_info(batch)
        assert info.local_loss_tokens == int((batch["labels"][:, 1:] != IGNORE).sum())
    flat = DataCollatorWithFlattening()
    assert collator_options(flat, shift_labels=True)["layout"] == "packed"
    masked = DataCollatorForLanguageModeling(tokenizer(mask=True), mlm=True)
    assert collator_options(masked, shift_labels=False) == {"loss_scaling": "none", "shift_labels": False}


def test_an_unknown_collator_error_says_what_odb_saw_and_assumed(tmp_path):
    # The samples carry no labels; the user's collator builds them from input_ids.
    data = [{"input_ids": s["input_ids"]} for s in W.causal_dataset(8)]

    def collate(samples):
        return W.pad_collate([dict(s, labels=s["input_ids"]) for s in samples])

    trainer = enable_odb(Trainer(model=W.llama(), args=args(tmp_path, ga=1), train_dataset=data,
                                 data_collator=collate), token_budget=64)
    with pytest.raises(ValueError) as info:
        trainer.train()
    msg = str(info.value)
    assert "What odb saw: sample" in msg and "has the fields ['input_ids']" in msg
    assert "What it assumed: without 'labels', all of its tokens are supervised" in msg
    assert "but the data collator collate() builds labels of its own" in msg and "loss_tokens_fn=" in msg
    assert "Rule: odb counts each sample's 'labels'" not in msg  # no rule about labels the samples never had


# ---- mistakes found when the trainer is configured, not at some step -----------------------------------


def test_a_sample_over_the_budget_is_refused_by_enable_odb(tmp_path):
    from transformers import DataCollatorForLanguageModeling

    tok = tokenizer()
    data = text_dataset(tok)
    longest = max(len(ids) for ids in data["input_ids"])
    collator = DataCollatorForLanguageModeling(tok, mlm=False)
    trainer = Trainer(model=W.llama(), args=args(tmp_path), train_dataset=data, data_collator=collator)
    with pytest.raises(ValueError, match=rf"sample \d+ of the training dataset has length {longest}, so alone it "
                                         rf"exceeds token_budget=16.*Fix: raise token_budget to at least {longest}"):
        enable_odb(trainer, token_budget=16)
    view = data.shuffle(seed=1).select(range(4))  # an indices mapping: lengths of the view's own rows
    short = min(range(len(view)), key=lambda i: len(view[i]["input_ids"]))
    fits = view.select([short])
    enable_odb(Trainer(model=W.llama(), args=args(tmp_path), train_dataset=fits, data_collator=collator),
               token_budget=len(fits[0]["input_ids"]))
    lengths = [len(ids) for ids in data["input_ids"]]
    trainer = Trainer(model=W.llama(), args=args(tmp_path), train_dataset=list(data), data_collator=collator)
    with pytest.raises(ValueError, match="exceeds token_budget=16"):
        enable_odb(trainer, token_budget=16, lengths=lengths)


def test_len_of_a_loader_whose_sample_cannot_fit_raises_the_oversize_error():
    data = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in [4, 6, 40, 5]]
    loader = odb.ODBDataLoader(data, token_budget=32, collate_fn=list)
    with pytest.raises(ValueError, match=r"a sample has length 40, so alone it exceeds token_budget=32.*"
                                         r"len\(loader\).*oversize='alone'"):
        len(loader)
    known = odb.ODBDataLoader(data, token_budget=32, collate_fn=list, lengths=[4, 6, 40, 5])
    with pytest.raises(ValueError, match=r"sample 2 has length 40, so alone it exceeds token_budget=32"):
        len(known)
    assert len(odb.ODBDataLoader(data, token_budget=32, collate_fn=list, oversize="alone")) >= 2


# ---- nothing to group, and what the Trainer's banner no longer says ---------------------------------


def test_samples_of_one_length_are_named_once_per_loader():
    chunks = [{"input_ids": torch.ones(16, dtype=torch.long)} for _ in range(80)]  # block_size chunks
    loader = odb.ODBDataLoader(chunks, token_budget=64, collate_fn=list)
    with pytest.warns(UserWarning, match=r"all 64 samples of the epoch's first window have length 16, so odb builds "
                                         r"fixed batches of 4 samples.*nothing to group.*tokenize without "
                                         r"concatenating") as seen:
        for epoch in range(2):
            loader.set_epoch(epoch)
            list(loader)
    assert len([w for w in seen if "nothing to group" in str(w.message)]) == 1
    varied = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in W.lengths_for(80)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(odb.ODBDataLoader(varied, token_budget=64, collate_fn=list))


def trainer_log(trainer: Trainer) -> List[str]:
    """The lines the Trainer logs at INFO (its train-start banner among them) while ``trainer`` trains."""
    from transformers.utils import logging as hf_logging

    lines: List[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, level = Keep(), hf_logging.get_verbosity()
    logging.getLogger("transformers.trainer").addHandler(handler)
    hf_logging.set_verbosity_info()
    try:
        trainer.train()
    finally:
        hf_logging.set_verbosity(level)
        logging.getLogger("transformers.trainer").removeHandler(handler)
    return lines


def test_the_trainer_banner_says_odb_sizes_the_batches(tmp_path):
    # Before: the banner read "Instantaneous batch size per device = 8", a batch size odb does not use.
    trainer = enable_odb(Trainer(model=W.llama(), args=args(tmp_path, ga=1), train_dataset=W.causal_dataset(8),
                                 data_collator=W.pad_collate), token_budget=64)
    assert trainer.args.per_device_train_batch_size == 8  # TrainingArguments' default, left as the user set it
    lines = trainer_log(trainer)
    banner = lines.index("***** Running training *****")
    [batch] = [line for line in lines if "Instantaneous batch size per device" in line]
    assert lines.index(batch) < banner + 8, "the line stays in the banner"
    assert batch.startswith("  Instantaneous batch size per device = set by odb: each optimizer step's samples split "
                            "into micro-batches of as many samples as fit token_budget=64 tokens per process")
    assert not any(line.endswith("per device = 8") for line in lines)
    [total] = [line for line in lines if "Total train batch size" in line]
    # the Trainer's own step: 8 per device x accumulation 1 x 1 process
    assert total.endswith("= 8 (odb: global_batch_size, the samples of every optimizer step)"), total
    assert len([line for line in lines if "token_budget=64" in line]) == 1
    assert "  Num Epochs = as many as max_steps=1 takes" in lines  # not 9,223,372,036,854,775,807
    # the filter that rewrote the banner is gone once training began: a plain Trainer's banner is its own
    assert not logging.getLogger("transformers.trainer").filters
    plain = Trainer(model=W.llama(), args=args(tmp_path / "plain", ga=1), train_dataset=W.causal_dataset(8),
                    data_collator=W.pad_collate)
    assert "  Instantaneous batch size per device = 8" in trainer_log(plain)


def test_a_banner_worded_otherwise_gets_odbs_line_under_it(tmp_path, monkeypatch):
    # Another transformers may word its banner otherwise: odb then logs its own line after the banner.
    from odb.integrations.hf import setup as hf_setup

    monkeypatch.setattr(hf_setup, "BANNER_BATCH", "Batch size per device in a wording of the future")
    trainer = enable_odb(Trainer(model=W.llama(), args=args(tmp_path, ga=1), train_dataset=W.causal_dataset(8),
                                 data_collator=W.pad_collate), token_budget=64)
    lines = trainer_log(trainer)
    banner = lines.index("***** Running training *****")
    [odb_line] = [k for k, line in enumerate(lines) if "token_budget=64" in line]
    assert banner < odb_line < banner + 14
    assert lines[odb_line].startswith("  odb: each batch holds each optimizer step's samples split into micro-batches "
                                      "of as many samples as fit token_budget=64 tokens")


def test_the_banner_of_budget_filled_steps_says_what_they_change(tmp_path):
    trainer = enable_odb(Trainer(model=W.llama(), args=args(tmp_path, ga=1), train_dataset=W.causal_dataset(8),
                                 data_collator=W.pad_collate), token_budget=64, global_batch_size=None)
    lines = trainer_log(trainer)
    [batch] = [line for line in lines if "Instantaneous batch size per device" in line]
    assert "batch size varies from step to step" in batch and "per_device_train_batch_size=8 is not used" in batch
    [total] = [line for line in lines if "Total train batch size" in line]
    assert re.search(r"= about \d+ samples per optimizer step on average \(odb: budget-filled steps, "
                     r"global_batch_size=None; it varies\)$", total), total
