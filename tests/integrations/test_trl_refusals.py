"""TRL's trainers that odb does not train exactly are refused at enable_odb, naming the trainer, the reason and
the fix; nothing about the trainer changes. Real TRL trainers (the pinned TRL) over tiny float64 Llamas from
configs and the offline tokenizer of tests/support/trl_workers.py.

Before: GRPO and RLOO crashed deep inside train() or mixed the prompts of a generation group; CPO and ORPO
would train as DPO did before odb learnt preference pairs (per-token weights where they average per pair,
micro-batches up to twice the budget). DPO and the reward trainer are trained exactly
(tests/integrations/test_trl_preference.py) and accepted here.
"""

from __future__ import annotations

import pytest

import datasets  # noqa: F401  (pinned under `make test`, as trl is: a broken install fails, never skips)
import trl
import trl_workers as W
from datasets import Dataset

from odb.integrations import hf as odb_hf
from odb.integrations import trl as odb_trl
from odb.integrations.hf import ODBTrainerMixin

pytestmark = pytest.mark.trl


def _reward(completions, **_):
    return [float(len(c)) for c in completions]


def _common(tmp_path):
    return dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1, per_device_train_batch_size=2)


def _pairs():
    return Dataset.from_dict({"prompt": ["a b", "c d"], "chosen": [" e", " f"], "rejected": [" g", " h"]})


def _prompts():
    return Dataset.from_dict({"prompt": ["a b", "c d"]})


def _reward_model():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    return LlamaForSequenceClassification(LlamaConfig(vocab_size=W.H.VOCAB, hidden_size=16, intermediate_size=32,
                                                      num_hidden_layers=1, num_attention_heads=2, num_labels=1,
                                                      pad_token_id=0))


def build(name, tmp_path):
    tok, c = W.tokenizer(), _common(tmp_path)
    if name == "DPOTrainer":
        return trl.DPOTrainer(model=W.H.llama(0), ref_model=W.H.llama(1), args=trl.DPOConfig(**c),
                              train_dataset=_pairs(), processing_class=tok)
    if name == "RewardTrainer":
        return trl.RewardTrainer(model=_reward_model(), args=trl.RewardConfig(**c), train_dataset=_pairs(),
                                 processing_class=tok)
    if name in ("CPOTrainer", "ORPOTrainer"):
        import warnings

        from trl.experimental import cpo, orpo

        module, config = (cpo, cpo.CPOConfig) if name == "CPOTrainer" else (orpo, orpo.ORPOConfig)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TRL's notice that experimental trainers may change
            return getattr(module, name)(model=W.H.llama(0), args=config(**c), train_dataset=_pairs(),
                                         processing_class=tok)
    if name == "KTOTrainer":
        data = Dataset.from_dict({"prompt": ["a b", "c d"], "completion": [" e", " f"], "label": [True, False]})
        return trl.KTOTrainer(model=W.H.llama(0), ref_model=W.H.llama(1), args=trl.KTOConfig(**c),
                              train_dataset=data, processing_class=tok)
    rl = dict(num_generations=2, max_completion_length=4, beta=0.0)
    if name == "GRPOTrainer":
        return trl.GRPOTrainer(model=W.H.llama(0), reward_funcs=_reward, args=trl.GRPOConfig(**c, **rl),
                               train_dataset=_prompts(), processing_class=tok)
    if name == "RLOOTrainer":
        return trl.RLOOTrainer(model=W.H.llama(0), reward_funcs=_reward, args=trl.RLOOConfig(**c, **rl),
                               train_dataset=_prompts(), processing_class=tok)
    raise ValueError(name)


# GRPO and RLOO: every enable_odb door takes them down odb.integrations.trl.rl (the loader path, ODBTrainerMixin,
# refuses them with that fix); their tests are tests/integrations/test_trl_grpo*.py.
REASONS = {"CPOTrainer": "averages its loss per pair", "ORPOTrainer": "averages its loss per pair",
           "KTOTrainer": "its loss and batching"}


@pytest.mark.parametrize("name", sorted(REASONS))
@pytest.mark.parametrize("enable", [odb_hf.enable_odb, odb_trl.enable_odb], ids=["hf", "trl"])
def test_trl_trainers_odb_does_not_train_exactly_are_refused_at_the_call(tmp_path, name, enable):
    trainer = build(name, tmp_path)
    cls, collator, loader = type(trainer), trainer.data_collator, trainer.get_train_dataloader
    with pytest.raises(TypeError) as refused:
        enable(trainer, token_budget=512)
    text = str(refused.value)
    assert text.startswith(f"odb cannot train TRL's {name} exactly: ") and REASONS[name] in text, text
    assert f"Fix: train this {name} without odb" in text and "SFTTrainer" in text.split("Rule:")[1]
    assert "GRPOTrainer and RLOOTrainer" in text.split("Rule:")[1]  # what odb does train, all of it
    # Refused before anything changed: the trainer trains as TRL made it.
    assert type(trainer) is cls and trainer.data_collator is collator
    assert trainer.get_train_dataloader.__func__ is loader.__func__


def test_a_users_subclass_of_a_refused_trainer_is_refused_too(tmp_path):
    trainer = build("KTOTrainer", tmp_path)

    class MyKTO(trl.KTOTrainer):  # a user's tweak of TRL's KTO keeps KTO's loss
        pass

    trainer.__class__ = MyKTO
    with pytest.raises(TypeError, match="odb cannot train TRL's KTOTrainer exactly"):
        odb_hf.enable_odb(trainer, token_budget=512)


@pytest.mark.parametrize("name", ["DPOTrainer", "RewardTrainer"])
@pytest.mark.parametrize("enable", [odb_hf.enable_odb, odb_trl.enable_odb], ids=["hf", "trl"])
def test_preference_trainers_are_accepted_with_their_pair_rules(tmp_path, name, enable):
    trainer = build(name, tmp_path)
    cls = type(trainer)

    class Mine(cls):  # a user's subclass keeps the pair rules of the TRL trainer it extends
        pass

    trainer.__class__ = Mine
    enabled = enable(trainer, token_budget=512)
    assert enabled is trainer and isinstance(trainer, ODBTrainerMixin) and isinstance(trainer, cls)
    assert trainer.odb_config.loss_scaling == "sample" and type(trainer.odb_config.length_fn).__name__ == "PairLength"


def test_the_mixin_path_refuses_at_construction(tmp_path):
    class ODBGRPO(ODBTrainerMixin, trl.GRPOTrainer):
        pass

    with pytest.raises(TypeError, match="odb cannot train TRL's GRPOTrainer exactly"):
        ODBGRPO(model=W.H.llama(0), reward_funcs=_reward, token_budget=512,
                args=trl.GRPOConfig(**_common(tmp_path), num_generations=2, max_completion_length=4, beta=0.0),
                train_dataset=_prompts(), processing_class=W.tokenizer())
