"""odb in the real HuggingFace Trainer (transformers 5, CPU): exact loss, sample-based progress, resume.

Models are tiny float64 Llama / T5 built from configs (random init); the exactness
reference is one process computing (sum of per-token losses) / (their count) over the
same samples in float64. The 2-rank runs use real gloo processes (tests/support/dist_harness.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import accelerate  # noqa: F401  (transformers' Trainer needs it; pinned: a broken install fails, never skips)
import datasets
import hf_workers as W
from dist_harness import run_ranks
from transformers import Trainer, TrainingArguments

import odb
from odb.integrations.hf import ODBTrainer, configure_trainer, enable_odb

EXACT = 1e-6  # the Llama loss runs in float32 inside transformers (logits.float()); T5's in float64


def rel_error(delta: dict, ref: dict) -> float:
    scale = max(r.abs().max().item() for r in ref.values())
    return max((delta[n] - r).abs().max().item() for n, r in ref.items()) / scale


def params(**kw) -> dict:
    p = dict(model="llama", n=24, ga=1, lr=1e-3, budget=60, max_steps=1)
    p.update(kw)
    return p


# ---- exact loss ---------------------------------------------------------------------------------


@pytest.mark.parametrize("model,ga,avg", [("llama", 1, True), ("llama", 2, False), ("plain_llama", 2, True),
                                          ("t5", 2, True)])
def test_one_step_equals_single_process_reference(tmp_path, model, ga, avg):
    p = params(model=model, ga=ga, avg_tokens=avg, out=str(tmp_path), budget=120 if model == "t5" else 60)
    r = W.train_ranks(0, 1, p)
    assert [i["micro_step"] for i in r["infos"]] == list(range(ga))
    assert sum(i["local_samples"] for i in r["infos"]) >= 2 * ga  # several samples per batch
    assert rel_error(r["delta"], W.reference_delta(p, r["ids"])) < (EXACT if model != "t5" else 1e-10)


# ---- the Trainer's own optimizer steps (the default: global_batch_size from TrainingArguments) -------------


@pytest.mark.parametrize("ga,per_device", [(1, 8), (3, 4)])
def test_default_keeps_the_trainers_samples_per_step(tmp_path, ga, per_device):
    """Each optimizer step holds per_device x accumulation samples, in as many micro-batches as they need (more
    than the Trainer's slots too: several then share a slot), the gradient is the step's exact token mean,
    and the epoch has ceil(n / that) steps, as the plain Trainer's."""
    p = params(ga=ga, same_updates=True, max_steps=-1, budget=60, out=str(tmp_path),
               args=dict(per_device_train_batch_size=per_device))
    r = W.train_ranks(0, 1, p)
    per_step = per_device * ga
    counts = [len(ids) for (_, _, ids, _) in r["steps"]]
    assert counts == [per_step] * (24 // per_step) + ([24 % per_step] if 24 % per_step else [])
    assert r["global_step"] == -(-24 // per_step)
    assert sorted(i for (_, _, ids, _) in r["steps"] for i in ids) == list(range(24))
    one = params(ga=ga, same_updates=True, max_steps=1, budget=60, out=str(tmp_path / "one"),
                 args=dict(per_device_train_batch_size=per_device))
    first = W.train_ranks(0, 1, one)
    assert len(first["ids"]) == per_step
    assert len(first["infos"]) > ga  # more micro-batches than slots: the StepBundle path ran
    assert rel_error(first["delta"], W.reference_delta(one, first["ids"])) < EXACT


def test_dataloader_drop_last_drops_only_the_partial_batch_as_the_trainer_does(tmp_path):
    """dataloader_drop_last with accumulation: the Trainer drops the partial last batch of per_device (24 samples,
    batches of 5: 4 whole batches) and steps on the 1 batch left after a full step of 3; odb keeps exactly
    those steps (before, it dropped the whole partial last step)."""
    p = params(ga=3, same_updates=True, max_steps=-1, budget=60, out=str(tmp_path),
               args=dict(per_device_train_batch_size=5, dataloader_drop_last=True))
    r = W.train_ranks(0, 1, p)
    assert [len(ids) for (_, _, ids, _) in r["steps"]] == [15, 5]
    assert r["global_step"] == 2


def test_budget_filled_steps_stay_an_explicit_choice(tmp_path):
    trainer = W.build_trainer(params(ga=2, same_updates=True, odb={"global_batch_size": None}), str(tmp_path))
    assert trainer.odb_config.global_batch_size is None and trainer.odb_config.gradient_accumulation_steps == 2
    trainer = W.build_trainer(params(ga=2, same_updates=True, args=dict(per_device_train_batch_size=3)),
                              str(tmp_path))
    assert trainer.odb_config.global_batch_size == 6 and trainer.odb_config.gradient_accumulation_steps == 1


def test_batch_without_supervised_tokens_adds_nothing(tmp_path):
    # T5 averages with CrossEntropyLoss: a batch whose labels are all -100 gives NaN (0/0) unless odb
    # replaces its loss by a zero that keeps the graph.
    p = params(model="t5", ga=4, budget=200, unsupervised=[i for i in range(24) if i % 2], out=str(tmp_path),
               odb={"max_batch_size": 1})
    r = W.train_ranks(0, 1, p)
    empty = [i["sample_ids"][0] for i in r["infos"] if i["local_loss_tokens"] == 0]
    supervised = [i for i in r["ids"] if i not in p["unsupervised"]]
    assert empty and supervised  # the step mixes both kinds
    assert all(torch.isfinite(d).all() for d in r["delta"].values())
    assert rel_error(r["delta"], W.reference_delta(p, supervised)) < 1e-10


@pytest.mark.dist
def test_two_ranks_exact_and_resumable(tmp_path):
    full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
    resume_args = dict(save_strategy="steps", save_steps=2, optim="adamw_torch", lr_scheduler_type="linear",
                       warmup_steps=1)
    runs = [params(ga=1, avg_tokens=True, out=str(tmp_path / "a")),
            params(ga=2, avg_tokens=False, out=str(tmp_path / "b")),
            params(model="plain_llama", ga=2, avg_tokens=True, out=str(tmp_path / "c")),
            # 3 samples, one per batch: rank 1 holds one sample for a 2-micro-batch step, so it runs a ghost
            params(n=3, ga=2, out=str(tmp_path / "g"), odb={"max_batch_size": 1},
                   args=dict(logging_strategy="steps", logging_steps=1)),
            params(ga=2, max_steps=-1, epochs=2, n=32, lr=1e-2, out=full, args=resume_args),
            params(ga=2, max_steps=-1, epochs=2, n=32, lr=1e-2, out=resumed, args=resume_args,
                   resume=os.path.join(full, "checkpoint-2")),
            # the default: the Trainer's 2 x 3 x 2 ranks = 12 samples per step, micro-batches as they need
            params(ga=3, same_updates=True, out=str(tmp_path / "s"), args=dict(per_device_train_batch_size=2))]
    exact, whole_run, resumed_run = [0, 1, 2, 3, 6], 4, 5
    ranks = run_ranks("hf_workers:suite_ranks", 2, {"runs": runs}, tmp_path / "h", deadline_s=240)
    same = [r[6] for r in ranks]
    assert sum(len(r["ids"]) for r in same) == 12
    assert len({len(r["infos"]) for r in same}) == 1  # equal micro-steps on both ranks
    for k in exact:
        ids = sorted(i for r in ranks for i in r[k]["ids"])
        assert len(ids) == len(set(ids)) >= 3
        ref = W.reference_delta(runs[k], ids)
        for rank, r in enumerate(ranks):
            assert rel_error(r[k]["delta"], ref) < EXACT, f"rank {rank}, run {runs[k]}"
    ghosts = [[i["is_ghost"] for i in r[3]["infos"]] for r in ranks]
    assert [sum(g) for g in ghosts] == [0, 1] and all(len(g) == 2 for g in ghosts)
    assert all(r[3]["log"][0]["odb_ghost_steps"] == 1 for r in ranks)  # summed over ranks
    for rank, r in enumerate(ranks):
        whole, tail = r[whole_run], r[resumed_run]
        assert whole["steps"][1][1] < 1.0  # checkpoint-2 is mid-epoch
        assert tail["steps"] == whole["steps"][2:], f"rank {rank} resumed with other steps"
        assert all(torch.equal(whole["params"][n], tail["params"][n]) for n in whole["params"]), f"rank {rank}"
    # every sample exactly once per epoch over both ranks, same step count on each rank
    steps = [r[whole_run]["steps"] for r in ranks]
    assert len(steps[0]) == len(steps[1])
    for epoch in (0, 1):
        seen = [i for s in steps for (_, e, ids, _) in s if epoch < e <= epoch + 1 for i in ids]
        assert sorted(seen) == list(range(32)), f"epoch {epoch}"


# ---- progress in samples ------------------------------------------------------------------------


def test_epochs_and_schedule_follow_the_samples(tmp_path):
    p = params(max_steps=-1, epochs=2, ga=2, lr=1e-2, out=str(tmp_path),
               args=dict(lr_scheduler_type="linear", warmup_steps=0.25, logging_strategy="steps", logging_steps=1))
    r = W.train_ranks(0, 1, p)
    steps = r["steps"]
    assert r["global_step"] == len(steps)
    for epoch in (0, 1):
        ids = [i for (_, e, s, _) in steps if epoch < e <= epoch + 1 for i in s]
        assert sorted(ids) == list(range(24))  # each epoch sees every sample once
    epochs = [e for (_, e, _, _) in steps]
    assert epochs == sorted(epochs) and epochs[-1] == 2.0 and 1.0 in epochs
    lrs = [lr for (*_, lr) in steps]
    assert lrs[-1] == 0.0 and min(lrs[:-1]) > 0.0  # decay ends with the data, not before
    peak = lrs.index(max(lrs))
    assert 0 < peak < len(lrs) - 1 and lrs[peak:] == sorted(lrs[peak:], reverse=True)
    logged = [entry for entry in r["log"] if "loss" in entry]
    assert len(logged) == len(steps) and logged[-1]["epoch"] == 2.0


def test_fractional_epochs_stop_within_one_step(tmp_path):
    p = params(max_steps=-1, epochs=1.5, ga=1, out=str(tmp_path))
    r = W.train_ranks(0, 1, p)
    epochs = [e for (_, e, _, _) in r["steps"]]
    assert epochs[-1] >= 1.5 > epochs[-2]


def test_max_steps_counts_optimizer_steps_across_epochs(tmp_path):
    p = params(max_steps=9, ga=2, out=str(tmp_path))
    r = W.train_ranks(0, 1, p)
    assert r["global_step"] == 9
    assert r["steps"][-1][1] > 1.0  # an epoch of 24 samples takes fewer than 9 steps: it went on


def test_logs_carry_odb_metrics(tmp_path):
    p = params(max_steps=4, ga=2, out=str(tmp_path), args=dict(logging_strategy="steps", logging_steps=2))
    r = W.train_ranks(0, 1, p)
    lines = [entry for entry in r["log"] if "loss" in entry]
    assert len(lines) == 2
    for line in lines:
        assert 0.0 <= line["odb_padding_ratio"] < 1.0
        assert line["odb_mean_batch_size"] >= 1.0 and line["odb_samples_per_second"] > 0
        assert line["odb_real_tokens_per_second"] > line["odb_samples_per_second"]
        assert line["odb_ghost_steps"] == 0


# ---- resume -------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:odb skipped")
def test_resume_mid_epoch_at_epoch_end_and_after_the_end_continue_exactly(tmp_path):
    # oversize="skip" drops the samples longer than the budget, so the first epoch emits fewer samples
    # than the dataset holds (a checkpoint at its last step cannot tell from the counts that it ended).
    out = str(tmp_path / "run")
    args = dict(save_strategy="steps", save_steps=1, optim="adamw_torch", lr_scheduler_type="linear",
                warmup_steps=2)
    p = params(max_steps=-1, epochs=2, ga=2, lr=1e-2, budget=26, out=out, args=args, odb={"oversize": "skip"})
    with pytest.warns(UserWarning, match="skipped"):
        whole = W.train_ranks(0, 1, p)
    assert max(W.lengths_for(24)) > 26
    end_of_epoch = max(step for (step, e, _, _) in whole["steps"] if e <= 1.0)
    last = whole["global_step"]
    assert 2 < end_of_epoch < last
    for at in (2, end_of_epoch, last):
        state = json.loads(Path(out, f"checkpoint-{at}", "odb_state_rank0.json").read_text())
        assert state["world_size"] == 1 and state["progress"]["in_epoch"]
        tail = W.train_ranks(0, 1, dict(p, out=str(tmp_path / f"resumed{at}"),
                                        resume=os.path.join(out, f"checkpoint-{at}")))
        assert tail["steps"] == whole["steps"][at:], f"resumed at step {at}"
        assert tail["global_step"] == last
        assert all(torch.equal(whole["params"][n], tail["params"][n]) for n in whole["params"])
    # ignore_data_skip=True: the interrupted epoch's data starts again (same order, same first batches)
    again = W.train_ranks(0, 1, dict(p, out=str(tmp_path / "again"), resume=os.path.join(out, "checkpoint-2"),
                                     args=dict(args, ignore_data_skip=True)))
    assert [ids for (_, _, ids, _) in again["steps"][:2]] == [ids for (_, _, ids, _) in whole["steps"][:2]]
    assert again["global_step"] == last + 2


def test_resume_refuses_checkpoint_without_odb_state(tmp_path):
    out = str(tmp_path / "plain")
    args = TrainingArguments(out, use_cpu=True, report_to="none", max_steps=1, save_strategy="steps", save_steps=1,
                             disable_tqdm=True)
    Trainer(model=W.llama(), args=args, train_dataset=W.causal_dataset(8), data_collator=W.pad_collate).train()
    trainer = ODBTrainer(model=W.llama(), args=args, train_dataset=W.causal_dataset(8), data_collator=W.pad_collate,
                         token_budget=64)
    with pytest.raises(ValueError, match="no odb state"):
        trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-1"))


# ---- seq2seq --------------------------------------------------------------------------------------


def test_seq2seq_trainer_t5_trains_under_both_budgets(tmp_path):
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

    data = W.seq2seq_dataset(32)
    shapes = []

    def collate(samples):
        batch = W.pad_collate(samples)
        shapes.append((batch["input_ids"].shape, batch["labels"].shape))
        return batch

    args = Seq2SeqTrainingArguments(str(tmp_path), use_cpu=True, report_to="none", disable_tqdm=True,
                                    num_train_epochs=3, learning_rate=3e-3, save_strategy="no", logging_steps=1,
                                    gradient_accumulation_steps=2)
    trainer = enable_odb(Seq2SeqTrainer(model=W.t5(), args=args, train_dataset=data, data_collator=collate),
                         token_budget=(64, 40), length_fn=odb.seq2seq_lengths, buffer_size=16)
    assert type(trainer).__name__ == "ODBSeq2SeqTrainer"
    rec = W.recorder(trainer)
    trainer.train()
    assert all(src[0] * src[1] <= 64 and tgt[0] * tgt[1] <= 40 for src, tgt in shapes)
    assert max(src[0] for src, _ in shapes) >= 2  # short pairs share batches
    seen = [i for (_, e, ids, _) in rec.steps if e <= 1.0 for i in ids]
    assert sorted(seen) == list(range(32))
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert sum(losses[-3:]) < sum(losses[:3])  # it learns


# ---- API: in place, untouched eval, errors ------------------------------------------------------


def test_enable_odb_changes_only_this_trainer(tmp_path):
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", max_steps=1, disable_tqdm=True,
                             save_strategy="no")
    data = W.causal_dataset(8)
    other = Trainer(model=W.llama(), args=args, train_dataset=data, eval_dataset=data, data_collator=W.pad_collate)
    trainer = enable_odb(Trainer(model=W.llama(), args=args, train_dataset=data, eval_dataset=data,
                                 data_collator=W.pad_collate), token_budget=64)
    assert type(other) is Trainer and isinstance(trainer, Trainer) and type(trainer).__name__ == "ODBTrainer"
    assert isinstance(trainer.get_train_dataloader(), odb.ODBDataLoader)
    assert not isinstance(other.get_train_dataloader(), odb.ODBDataLoader)
    assert not isinstance(trainer.get_eval_dataloader(), odb.ODBDataLoader)
    assert trainer.odb_config.gradient_accumulation_steps == 1 and trainer.odb_config.shift_labels
    assert "eval_loss" in trainer.evaluate()
    with pytest.raises(ValueError, match="already uses odb"):
        enable_odb(trainer, token_budget=64)


def test_bad_settings_are_refused_with_the_fix(tmp_path):
    data = W.causal_dataset(8)

    def build(**kw):
        args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", max_steps=1, **kw)
        return Trainer(model=W.llama(), args=args, train_dataset=data, data_collator=W.pad_collate)

    # group_by_length's steps are kept (tests/integrations/test_hf_sampling.py): odb options that would not keep them
    with pytest.raises(ValueError, match=r"global_batch_size=None with train_sampling_strategy='group_by_length'.*"
                                         r"Fix: leave global_batch_size unset"):
        enable_odb(build(train_sampling_strategy="group_by_length"), token_budget=64, global_batch_size=None)
    with pytest.raises(ValueError, match=r"composition='length_grouped' with train_sampling_strategy="
                                         r"'batch_rebalance'.*Fix: leave composition unset"):
        enable_odb(build(train_sampling_strategy="batch_rebalance"), token_budget=64, composition="length_grouped")
    with pytest.raises(ValueError, match="gradient_accumulation_steps=3 .* accumulates 2"):
        enable_odb(build(gradient_accumulation_steps=2), token_budget=64, gradient_accumulation_steps=3)
    with pytest.raises(TypeError, match="token_budget"):
        enable_odb(build())
    with pytest.raises(TypeError, match="not a transformers.Trainer"):
        enable_odb(object(), token_budget=64)


def test_label_count_mismatch_is_an_error_naming_the_fix(tmp_path):
    # The samples carry no labels (the collator builds them): odb's per-sample count would be off by one
    # per sample for a causal LM, which is refused rather than scaled wrongly.
    data = [{"input_ids": s["input_ids"]} for s in W.causal_dataset(8)]

    def collate(samples):
        batch = W.pad_collate([dict(s, labels=s["input_ids"]) for s in samples])
        return batch

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", max_steps=1, disable_tqdm=True)
    trainer = ODBTrainer(model=W.llama(), args=args, train_dataset=data, data_collator=collate, token_budget=64)
    with pytest.raises(ValueError, match="loss_tokens_fn"):
        trainer.train()
    fixed = ODBTrainer(model=W.llama(), args=args, train_dataset=data, data_collator=collate, token_budget=64,
                       loss_tokens_fn=lambda s: len(s["input_ids"]) - 1)
    assert fixed.train().global_step == 1


def test_configure_trainer_returns_an_odb_ready_copy(tmp_path):
    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", per_device_train_batch_size=8,
                             train_sampling_strategy="group_by_length", auto_find_batch_size=True)
    ready = configure_trainer(args, num_train_epochs=2)
    # the per-device batch stays: it sets the samples of each optimizer step (global_batch_size); so does the
    # sampling strategy, whose steps odb keeps
    assert (ready.per_device_train_batch_size, ready.train_sampling_strategy, ready.auto_find_batch_size,
            ready.num_train_epochs) == (8, "group_by_length", False, 2)
    assert args.per_device_train_batch_size == 8 and args.auto_find_batch_size


def test_import_odb_does_not_import_transformers():
    code = ("import sys, odb, odb.integrations; "
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("script", ["hf_trainer.py", "seq2seq_trainer.py"])
def test_examples_run(tmp_path, monkeypatch, capsys, script):
    import runpy

    examples = Path(__file__).resolve().parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    argv = [script, "--samples", "48", "--epochs", "1", "--workers", "0", "--out", str(tmp_path)]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(examples / script), run_name="__main__")
    assert "optimizer steps, train loss" in capsys.readouterr().out


def test_hf_datasets_dataset_with_lengths_and_unused_columns(tmp_path):
    rows = W.causal_dataset(20)
    ds = datasets.Dataset.from_dict({"input_ids": [r["input_ids"].tolist() for r in rows],
                                     "labels": [r["labels"].tolist() for r in rows],
                                     "text": [f"sample {i}" for i in range(20)],  # not a model input: removed
                                     "length": [len(r["input_ids"]) for r in rows]})

    def collate(features):
        return W.pad_collate([{k: torch.tensor(v) for k, v in f.items()} for f in features])

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", num_train_epochs=1, disable_tqdm=True,
                             save_strategy="no", gradient_accumulation_steps=2)
    trainer = ODBTrainer(model=W.llama(), args=args, train_dataset=ds, data_collator=collate, token_budget=60,
                         lengths=ds["length"])
    rec = W.recorder(trainer)
    trainer.train()
    assert sorted(i for (_, _, ids, _) in rec.steps for i in ids) == list(range(20))
    assert trainer.state.epoch == 1.0


def test_a_transformers_that_divides_the_loss_twice_is_refused_with_the_fix(tmp_path, monkeypatch):
    # transformers 5.3.0-5.5.3 divide each micro-batch's loss by gradient_accumulation_steps in the Trainer and
    # again in the Accelerator (tests/integrations/test_hf.py fails there by exactly that factor); 5.5.4 fixed it.
    import transformers

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    trainer = Trainer(model=W.llama(), args=args, train_dataset=W.causal_dataset(8), data_collator=W.pad_collate)
    monkeypatch.setattr(transformers, "__version__", "5.5.3")
    with pytest.raises(RuntimeError, match=r"needs transformers>=5\.5\.4: transformers 5\.5\.3 divides the loss by "
                                           r"gradient_accumulation_steps twice.*Fix: install transformers>=5\.5\.4"):
        enable_odb(trainer, token_budget=64)
    monkeypatch.setattr(transformers, "__version__", "5.5.4")
    assert enable_odb(trainer, token_budget=64) is trainer
