"""odb in TRL's real SFTTrainer (trl 0.24, transformers 5, CPU): exact loss in every label mode, resume.

TRL prepares the data (tokenization, ``completion_mask``, ``assistant_masks``) and its
own ``DataCollatorForLanguageModeling`` builds the labels; odb counts supervised tokens
per sample before that collator runs, so the counts must agree exactly. Models are tiny
float64 Llamas from configs, the tokenizer is trained offline (tests/support/trl_workers.py).
The 2-process runs use real gloo processes (tests/support/dist_harness.py).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

import datasets  # noqa: F401  (pinned under `make test`, as trl is: a broken install fails, never skips)
import trl  # noqa: F401
import trl_workers as W
from dist_harness import run_ranks

from odb import PackedLayoutError
from odb.integrations.hf.steps import batch_loss_tokens
from odb.integrations.trl import SFTLossTokens

# `make test-min` (no TRL at the declared floors) ignores this file and deselects -m trl.
pytestmark = pytest.mark.trl

EXACT = 1e-6  # the Llama loss runs in float32 inside transformers (logits.float())
KINDS = [("text", False), ("text", True), ("completion", False), ("completion", True), ("assistant", False),
         ("assistant", True)]


def rel_error(delta: dict, ref: dict) -> float:
    scale = max(r.abs().max().item() for r in ref.values())
    return max((delta[n] - r).abs().max().item() for n, r in ref.items()) / scale


def params(**kw) -> dict:
    p = dict(kind="text", n=24, ga=2, lr=1e-3, budget=120, max_steps=1)
    p.update(kw)
    return p


# ---- supervised tokens: odb's count per sample equals the count in TRL's collated batch ----------------


@pytest.mark.parametrize("padding_free", [False, True])
def test_sample_counts_add_up_to_the_collated_labels(padding_free):
    # TRL >= 1.9: the trainer writes -100 outside completion_mask/assistant_masks while it prepares the dataset; the
    # collator reads labels only, and ignores mask columns a prepared dataset of the user's still holds.
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    collator = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=padding_free)
    assert not hasattr(collator, "completion_only_loss")  # the pinned TRL: labels come with the samples
    count = SFTLossTokens(False, masks=False)
    g = torch.Generator().manual_seed(0)
    for fields in (("input_ids",), ("input_ids", "labels"), ("input_ids", "labels", "completion_mask",
                                                             "assistant_masks")):
        for _ in range(20):
            lengths = torch.randint(1, 12, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
            samples = []
            for n in lengths:
                s = {"input_ids": torch.randint(1, 40, (n,), generator=g).tolist()}
                if "labels" in fields:
                    s["labels"] = [v if torch.rand((), generator=g) < 0.7 else -100 for v in s["input_ids"]]
                for key in fields[2:]:
                    s[key] = (torch.rand(n, generator=g) < 0.6).long().tolist()
                samples.append(s)
            seen = batch_loss_tokens(collator(samples), shift=True, ignore_index=-100)
            assert sum(count(s) for s in samples) == seen, (fields, samples)


# ---- exact loss in every mode ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind,padding_free", KINDS + [("completion", "known")])
def test_one_step_equals_single_process_reference(tmp_path, kind, padding_free):
    # Without odb's TRL rules this stops at the first step: odb counted each sample's input_ids
    # while TRL's labels drop the first token (and the prompt, or the user's turns).
    known = padding_free == "known"
    p = params(kind=kind, padding_free=padding_free is True, known_lengths=known, out=str(tmp_path / "run"))
    r = W.train_ranks(0, 1, p)
    assert [i["micro_step"] for i in r["infos"]] == [0, 1]
    assert sum(i["local_samples"] for i in r["infos"]) >= 4  # several samples per batch
    ref = W.reference(W.build_trainer(p, str(tmp_path / "ref")), r["ids"], p["lr"])
    assert sum(i["local_loss_tokens"] for i in r["infos"]) == ref["tokens"]
    assert rel_error(r["delta"], ref["delta"]) < EXACT
    if padding_free is True:  # one padding-free row per batch, packed up to the budget
        assert r["layout"] == "packed" and set(r["rows"]) == {1}
        assert all(i["padded_tokens"] == i["real_tokens"] <= p["budget"] for i in r["infos"])
    else:
        assert r["layout"] == "padded" and max(r["rows"]) > 1
        assert all(i["padded_tokens"] <= p["budget"] for i in r["infos"])


def test_one_forward_per_micro_batch_and_no_deprecated_outputs(tmp_path):
    # TRL >= 1.15 computes the loss through a fused LM head and answers return_outputs=True (which odb asked for
    # before) with a FutureWarning and an extra no-grad forward that builds the full logits.
    p = params(kind="completion", out=str(tmp_path / "run"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = W.train_ranks(0, 1, p)
    assert not [w for w in caught if "return_outputs" in str(w.message)], [str(w.message) for w in caught]
    assert r["forwards"] == len(r["infos"]) == 2  # gradient accumulation 2: two micro-batches, one forward each
    ref = W.reference(W.build_trainer(p, str(tmp_path / "ref")), r["ids"], p["lr"])
    assert rel_error(r["delta"], ref["delta"]) < EXACT


def test_padding_free_with_odb_varlen_attention_is_exact(tmp_path):
    # The per-sample attention a padding-free row needs to be fast (docs/packing.md), in TRL's own pipeline.
    p = params(kind="assistant", padding_free=True, attn="odb_varlen", out=str(tmp_path / "run"))
    r = W.train_ranks(0, 1, p)
    assert r["layout"] == "packed" and set(r["rows"]) == {1}
    assert sum(i["local_samples"] for i in r["infos"]) >= 4
    ref = W.reference(W.build_trainer(dict(p, attn=None), str(tmp_path / "ref")), r["ids"], p["lr"])
    assert sum(i["local_loss_tokens"] for i in r["infos"]) == ref["tokens"]
    assert rel_error(r["delta"], ref["delta"]) < EXACT


# ---- epochs and schedule in samples, resume ----------------------------------------------------------


def resume_runs(tmp_path: Path, **kw) -> tuple:
    resume_args = dict(save_strategy="steps", save_steps=2, optim="adamw_torch", lr_scheduler_type="linear",
                       warmup_steps=1)
    base = params(max_steps=-1, epochs=2, n=20, lr=1e-2, budget=40, args=resume_args)
    base.update(kw)
    full = dict(base, out=str(tmp_path / "full"))
    return full, dict(base, out=str(tmp_path / "resumed"), resume=os.path.join(full["out"], "checkpoint-2"))


def check_epochs_and_resume(whole: dict, tail: dict, n: int, steps_of_others: list = ()) -> None:
    steps = [whole["steps"]] + list(steps_of_others)
    for epoch in (0, 1):  # every sample exactly once per epoch (over all ranks)
        seen = [i for s in steps for (_, e, ids, _) in s if epoch < e <= epoch + 1 for i in ids]
        assert sorted(seen) == list(range(n)), f"epoch {epoch}"
    epochs = [e for (_, e, _, _) in whole["steps"]]
    assert epochs == sorted(epochs) and 1.0 in epochs and epochs[-1] == whole["epoch"] == 2.0
    assert whole["steps"][-1][3] == 0.0 < whole["steps"][-2][3]  # the linear decay ends with the last step
    assert whole["steps"][1][1] < 1.0  # checkpoint-2 is mid-epoch
    assert tail["steps"] == whole["steps"][2:]
    assert all(torch.equal(whole["params"][k], tail["params"][k]) for k in whole["params"])


@pytest.mark.parametrize("kind,padding_free,workers", [("completion", False, 0), ("assistant", True, 2)])
def test_epochs_schedule_and_resume_follow_the_samples(tmp_path, kind, padding_free, workers):
    full, resumed = resume_runs(tmp_path, kind=kind, padding_free=padding_free, workers=workers)
    whole, tail = W.train_ranks(0, 1, full), W.train_ranks(0, 1, resumed)
    check_epochs_and_resume(whole, tail, full["n"])


@pytest.mark.dist
def test_two_processes_exact_and_resumable(tmp_path):
    full, resumed = resume_runs(tmp_path, kind="text", ga=1, budget=40)  # 3+ steps per epoch on each rank
    runs = [params(kind="completion", out=str(tmp_path / "a")),
            params(kind="assistant", padding_free=True, ga=1, out=str(tmp_path / "b")),
            full, resumed,
            # a model with accepts_loss_kwargs=False: TRL >= 1.15 multiplies its loss by the processes all the same
            params(kind="completion", no_loss_kwargs=True, out=str(tmp_path / "c"))]
    ranks = run_ranks("trl_workers:suite_ranks", 2, {"runs": runs}, tmp_path / "h", deadline_s=280)
    assert ranks[0][4]["accepts_loss_kwargs"] is False
    for k in (0, 1, 4):
        ids = sorted(i for r in ranks for i in r[k]["ids"])
        assert len(ids) == len(set(ids)) >= 4
        ref = W.reference(W.build_trainer(runs[k], str(tmp_path / f"ref{k}")), ids, runs[k]["lr"])
        assert sum(i["local_loss_tokens"] for r in ranks for i in r[k]["infos"]) == ref["tokens"]
        for rank, r in enumerate(ranks):
            assert rel_error(r[k]["delta"], ref["delta"]) < EXACT, f"rank {rank}, run {runs[k]}"
    assert ranks[0][1]["layout"] == "packed" and set(ranks[0][1]["rows"]) == {1}
    for rank, r in enumerate(ranks):
        others = [o[2]["steps"] for o in ranks if o is not r]
        check_epochs_and_resume(r[2], r[3], full["n"], others)
    assert len(ranks[0][2]["steps"]) == len(ranks[1][2]["steps"])


# ---- settings odb refuses, with the fix --------------------------------------------------------------


def sft_trainer(tmp_path: Path, model=None, **config):
    from trl import SFTTrainer

    p = params(kind="completion")
    args = W.sft_config(dict(p, args=config), str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(model=model if model is not None else W.H.llama(), args=args,
                          train_dataset=W.raw_dataset("completion", 8), processing_class=W.tokenizer())


@pytest.mark.parametrize("config,odb,exc,words", [
    ({"packing": True, "max_length": 64}, {}, ValueError,
     ["packing=True", "max_length=64", "Fix: packing=False", "padding_free=True"]),
    ({"padding_free": True}, {"layout": "padded"}, ValueError,
     ["layout='padded'", "padding_free=True", "Fix: leave layout out"]),
    ({}, {"layout": "packed"}, ValueError, ["layout='packed'", "pads each batch", "Fix: set padding_free=True"]),
    ({"pad_to_multiple_of": 8}, {"pad_to_multiple_of": 4}, ValueError,
     ["pad_to_multiple_of=4", "multiple of 8", "Fix: pass pad_to_multiple_of=8"]),
    ({"pad_to_multiple_of": 8, "padding_free": True}, {}, ValueError,
     ["pad_to_multiple_of=8 with padding_free=True", "Fix: pad_to_multiple_of=None"]),
    ({}, {"ignore_index": -1}, ValueError, ["ignore_index=-1", "-100", "Fix: leave ignore_index out"]),
])
def test_bad_settings_are_refused_with_the_fix(tmp_path, config, odb, exc, words):
    from odb.integrations.trl import enable_odb

    trainer = sft_trainer(tmp_path, **config)
    with pytest.raises(exc) as info:
        enable_odb(trainer, token_budget=256, **odb)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_collator_settings_become_odb_options(tmp_path):
    from odb.integrations.hf import enable_odb

    trainer = enable_odb(sft_trainer(tmp_path, pad_to_multiple_of=8), token_budget=256)
    assert trainer.odb_config.pad_to_multiple_of == 8 and trainer.odb_config.layout == "padded"
    assert isinstance(trainer.odb_config.loss_tokens_fn, SFTLossTokens)
    mine = lambda s: len(s["input_ids"]) - 1  # noqa: E731  (the user's own count wins)
    trainer = enable_odb(sft_trainer(tmp_path, padding_free=True), token_budget=256, loss_tokens_fn=mine)
    assert trainer.odb_config.layout == "packed" and trainer.odb_config.loss_tokens_fn is mine


def test_padding_free_refuses_a_model_that_mixes_packed_samples(tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    from odb.integrations.trl import enable_odb

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=48, hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                     num_attention_heads=2, word_embed_proj_dim=16, max_position_embeddings=128))
    trainer = sft_trainer(tmp_path, model=model, padding_free=True)
    with pytest.raises(PackedLayoutError) as info:
        enable_odb(trainer, token_budget=256, packed_attention="model")  # OPT's own sdpa mixes packed samples
    msg = str(info.value)
    assert "padding_free=True" in msg and "OPTForCausalLM" in msg and "set padding_free=False" in msg
    # odb_varlen (the default) attends within each sample by the restarting position_ids: exact for OPT too
    trainer = enable_odb(sft_trainer(tmp_path, model=model, padding_free=True), token_budget=256)
    assert trainer.model.config._attn_implementation == "odb_varlen"


def test_padding_free_switches_a_dense_mask_attention_to_odb_varlen(tmp_path, caplog):
    # Before: the model kept its dense-mask attention (2.4x slower than training without odb); odb only warned.
    import logging

    from odb.integrations.trl import enable_odb

    with caplog.at_level(logging.WARNING, logger="odb"):
        trainer = enable_odb(sft_trainer(tmp_path, padding_free=True), token_budget=256)
    assert trainer.model.config._attn_implementation == "odb_varlen"
    switched = [r.getMessage() for r in caplog.records if "switched" in r.getMessage()]
    assert len(switched) == 1 and "from 'eager' to 'odb_varlen'" in switched[0]
    assert "packed_attention='model'" in switched[0]
    sdpa = W.H.llama()
    sdpa.set_attn_implementation("sdpa")  # from_pretrained's default: the run of issue 19 that took 2.4x longer
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="odb"):
        trainer = enable_odb(sft_trainer(tmp_path, model=sdpa, padding_free=True), token_budget=256)
    assert trainer.model.config._attn_implementation == "odb_varlen"
    switched = [r.getMessage() for r in caplog.records if "switched" in r.getMessage()]
    assert len(switched) == 1 and "from 'sdpa' to 'odb_varlen'" in switched[0]
    with pytest.warns(UserWarning, match="dense block-diagonal mask"):  # kept on request: odb says what it costs
        kept = enable_odb(sft_trainer(tmp_path, padding_free=True), token_budget=256, packed_attention="model")
    assert kept.model.config._attn_implementation == "eager"
    padded = enable_odb(sft_trainer(tmp_path), token_budget=256)  # padded batches: the model is left alone
    assert padded.model.config._attn_implementation == "eager"
    with pytest.raises(ValueError, match=r"packed_attention='flash' is not one of.*Fix: pass packed_attention="):
        enable_odb(sft_trainer(tmp_path, padding_free=True), token_budget=256, packed_attention="flash")


def test_a_budget_below_max_length_is_refused_at_enable_odb(tmp_path):
    # Before: enable_odb accepted it, and training stopped at the first window holding a longer sample.
    from odb.integrations.trl import enable_odb

    trainer = sft_trainer(tmp_path, max_length=64)
    longest = max(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert longest > 12
    with pytest.raises(ValueError, match=rf"has length {longest}, so alone it exceeds token_budget=12.*Fix: raise "
                                         rf"token_budget to at least {longest}, set max_length=12 or less in the "
                                         rf"SFTConfig \(now 64; TRL truncates samples to it\)"):
        enable_odb(trainer, token_budget=12)
    enable_odb(sft_trainer(tmp_path, max_length=12), token_budget=12)  # TRL truncates to the budget: accepted
    enable_odb(sft_trainer(tmp_path, max_length=64), token_budget=12, oversize="alone")


def test_trl_enable_odb_refuses_other_trainers(tmp_path):
    from transformers import Trainer, TrainingArguments

    from odb.integrations.trl import enable_odb

    trainer = Trainer(model=W.H.llama(), args=TrainingArguments(str(tmp_path), use_cpu=True, report_to="none"),
                      train_dataset=W.H.causal_dataset(4), data_collator=W.H.pad_collate)
    with pytest.raises(TypeError, match="got Trainer, not a trl.SFTTrainer, DPOTrainer, RewardTrainer, GRPOTrainer "
                                        "or RLOOTrainer.*Fix: .*odb.integrations.hf.enable_odb"):
        enable_odb(trainer, token_budget=64)


def test_example_runs(tmp_path, monkeypatch, capsys):
    import runpy

    examples = Path(__file__).resolve().parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    argv = ["trl_sft.py", "--samples", "48", "--epochs", "1", "--out", str(tmp_path), "--padding-free"]
    monkeypatch.setattr(sys, "argv", argv)
    runpy.run_path(str(examples / "trl_sft.py"), run_name="__main__")
    assert "optimizer steps, train loss" in capsys.readouterr().out


# ---- the user's optimizer steps (the default: global_batch_size from SFTConfig) ------------------------


@pytest.mark.parametrize("kind,padding_free", [("completion", False), ("assistant", True)])
def test_default_step_holds_the_users_samples_exactly(tmp_path, kind, padding_free):
    # each step holds per_device_train_batch_size x gradient_accumulation_steps samples, in odb's micro-batches
    p = params(kind=kind, padding_free=padding_free, same_updates=True, args=dict(per_device_train_batch_size=5),
               out=str(tmp_path / "run"))
    r = W.train_ranks(0, 1, p)
    assert len(r["ids"]) == 10  # 5 x 2: the plain SFTTrainer's first step
    assert [i["micro_step"] for i in r["infos"]] == list(range(len(r["infos"])))
    ref = W.reference(W.build_trainer(p, str(tmp_path / "ref")), r["ids"], p["lr"])
    assert sum(i["local_loss_tokens"] for i in r["infos"]) == ref["tokens"]
    assert rel_error(r["delta"], ref["delta"]) < EXACT
