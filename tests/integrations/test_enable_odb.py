"""``odb.enable_odb(trainer)`` trains every kind of trainer odb supports, dispatched by the trainer's type, and the
older doors (``odb.integrations.hf.enable_odb``, ``odb.integrations.trl.enable_odb``,
``odb.integrations.llamafactory.enable_odb(trainer=...)``) are the same call: none refuses a trainer for coming
through it.

One process, tiny float64 models, one or two optimizer steps each, built with the shared builders of
tests/support (hf_workers, trl_workers, trl_rl_workers) without odb, then switched by ``odb.enable_odb``. Each
test checks that the trainer took odb's path for its kind (odb's loader and step infos, or odb's micro-batches
of the RL policy update) and that every parameter it trains changed. The exactness of each path is tested in
the framework's own file (test_hf.py, test_trl.py, test_trl_preference.py, test_trl_grpo.py); LLaMA-Factory's
trainer, the ninth kind, runs in test_llamafactory.py (its own environment):
``test_odb_enable_odb_takes_llamafactorys_trainer``.
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List

import pytest
import torch

import hf_workers as H

import odb
from odb.integrations import hf as odb_hf
from odb.integrations.trainer_kinds import trainer_kind


def snapshot(trainer: Any) -> Dict[str, torch.Tensor]:
    return {n: w.detach().clone() for n, w in trainer.model.named_parameters() if w.requires_grad}


def changed(before: Dict[str, torch.Tensor], trainer: Any) -> List[str]:
    """The trained parameters that did not change (empty when every one did)."""
    now = dict(trainer.model.named_parameters())
    return [n for n, w in before.items() if torch.equal(w, now[n].detach())]


def train(trainer: Any) -> Dict[str, torch.Tensor]:
    before = snapshot(trainer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return before


def hf_args(tmp_path: Any, seq2seq: bool = False) -> Any:
    return H.make_args(dict(model="t5" if seq2seq else "llama", lr=0.1, ga=2, max_steps=2), str(tmp_path))


def test_every_door_is_odb_enable_odb():
    from odb.integrations import trl as odb_trl

    assert odb_hf.enable_odb is odb.enable_odb and odb_trl.enable_odb is odb.enable_odb
    with pytest.raises(TypeError, match="odb.enable_odb got DataLoader, not a transformers.Trainer.*odb.apply"):
        odb.enable_odb(torch.utils.data.DataLoader([1, 2]), token_budget=64)


@pytest.mark.parametrize("seq2seq", [False, True], ids=["Trainer", "Seq2SeqTrainer"])
def test_transformers_trainers(tmp_path, seq2seq):
    from transformers import Seq2SeqTrainer, Trainer

    if seq2seq:
        trainer = Seq2SeqTrainer(model=H.t5(), args=hf_args(tmp_path, True), train_dataset=H.seq2seq_dataset(16),
                                 data_collator=H.pad_collate)
    else:
        trainer = Trainer(model=H.llama(), args=hf_args(tmp_path), train_dataset=H.causal_dataset(16),
                          data_collator=H.pad_collate)
    assert trainer_kind(trainer) == "hf"
    assert odb.enable_odb(trainer, token_budget=128, buffer_size=8) is trainer
    before = train(trainer)
    assert trainer.state.global_step == 2 and trainer.odb_step_infos and not changed(before, trainer)
    if seq2seq:  # the encoder-decoder default: source and target both count against the budget
        assert trainer.odb_config.length_fn is odb.seq2seq_lengths


@pytest.mark.trl
def test_trl_sft_trainer(tmp_path):
    import trl_workers as W
    from trl import SFTTrainer

    p = dict(kind="completion", max_steps=2, ga=2, lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = SFTTrainer(model=H.llama(0), args=W.sft_config(p, str(tmp_path)),
                             train_dataset=W.raw_dataset("completion", 16), processing_class=W.tokenizer())
    assert trainer_kind(trainer) == "hf"
    odb.enable_odb(trainer, token_budget=128, buffer_size=8)
    before = train(trainer)
    assert trainer.state.global_step == 2 and trainer.odb_step_infos and not changed(before, trainer)
    assert type(trainer.odb_config.loss_tokens_fn).__name__ == "SFTLossTokens"  # TRL's labels, counted TRL's way


@pytest.mark.trl
@pytest.mark.parametrize("kind", ["dpo", "reward"])
def test_trl_preference_trainers(tmp_path, kind):
    import trl_workers as W

    trainer = W.pair_trainer(dict(trainer=kind, n=12, max_steps=1, lr=0.1), str(tmp_path))
    assert trainer_kind(trainer) == "hf"
    odb.enable_odb(trainer, token_budget=256, buffer_size=8)
    before = train(trainer)
    assert trainer.state.global_step == 1 and trainer.odb_step_infos
    assert trainer.odb_config.loss_scaling == "sample"  # a pair is one unit: TRL's mean per pair
    assert not changed(before, trainer)


def _my_grpo(trainer: Any) -> Any:
    import trl

    class MyGRPO(trl.GRPOTrainer):  # a user's subclass: dispatched by the TRL class it extends
        pass

    trainer.__class__ = MyGRPO
    return trainer


@pytest.mark.trl
@pytest.mark.parametrize("kind,door,adapt", [
    ("grpo", odb.enable_odb, lambda t: t),
    ("rloo", odb.enable_odb, lambda t: t),
    ("grpo", odb.enable_odb, _my_grpo),
    ("grpo", odb_hf.enable_odb, lambda t: t),  # before: refused, pointing to odb.integrations.trl.enable_odb
], ids=["GRPOTrainer", "RLOOTrainer", "a subclass of GRPOTrainer", "GRPOTrainer through odb.integrations.hf"])
def test_trl_rl_trainers(tmp_path, kind, door, adapt):
    import trl_rl_workers as R

    trainer = adapt(R.build(dict(trainer=kind, max_steps=1), str(tmp_path), R.GradRecorder()))
    loader = trainer.get_train_dataloader
    assert trainer_kind(trainer) == "rl"
    assert door(trainer, token_budget=40) is trainer
    before = train(trainer)
    counts = trainer.odb_rl.counts
    assert trainer.state.global_step == 1 and counts.micro_steps >= 1 and counts.real_tokens > 0
    assert trainer.get_train_dataloader.__func__ is loader.__func__  # TRL's sampler and loader stay TRL's
    assert not changed(before, trainer)


@pytest.mark.trl
def test_rl_trainers_refuse_loader_options_naming_the_ones_they_take(tmp_path):
    import trl_rl_workers as R

    trainer = R.build(dict(trainer="grpo"), str(tmp_path), R.GradRecorder())
    with pytest.raises(TypeError, match=r"got \['buffer_size'\] for GRPOTrainer, which takes token_budget, layout, "
                                        r"step_plan and packed_attention only.*Fix: "):
        odb.enable_odb(trainer, token_budget=40, buffer_size=8)
    assert not hasattr(trainer, "odb_rl")
