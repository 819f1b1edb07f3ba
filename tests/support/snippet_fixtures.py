"""What each guide snippet assumes and does not build itself, for tests/project/test_doc_snippets.py.

A fixture ``NAME()`` returns the namespace the snippet ``<!-- odb-snippet: NAME -->`` runs in (``model``,
``tokenizer``, ``dataset``, ``collate_fn``, a ``my_sft.yaml``...: a tiny random model, a word-level
tokenizer trained on generated sentences, no download) and a check of what the snippet did (it trained:
finite loss, parameters changed; or it built what it says). It runs in the snippet's own interpreter, in an
empty working folder.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
Fixture = Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]

WORDS = ("the cat dog bird sees runs jumps over under a small large red blue green house tree river boat "
         "quickly slowly today yesterday and but with near far old new happy sad").split()


def texts(n: int = 48, seed: int = 0) -> List[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(int(round(2 * 20 ** rng.random())))) for _ in range(n)]


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_llama(tokenizer: Any, seed: int = 0) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id))


def causal_samples(tokenizer: Any) -> List[Dict[str, Any]]:
    """Tokenized causal-LM samples: labels are the input_ids (the model shifts them)."""
    return [{"input_ids": ids, "labels": list(ids)} for ids in tokenizer(texts())["input_ids"]]


def lm_world() -> Dict[str, Any]:
    """model, tokenizer, dataset (tokenized, with labels), collate_fn (DataCollatorForSeq2Seq), optimizer."""
    import torch
    from transformers import DataCollatorForSeq2Seq

    tokenizer = tiny_tokenizer()
    model = tiny_llama(tokenizer)
    return dict(tokenizer=tokenizer, model=model, dataset=causal_samples(tokenizer),
                collate_fn=DataCollatorForSeq2Seq(tokenizer), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def trained(before: List[Any], model: Any) -> None:
    import torch

    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    if not all(changed):
        raise AssertionError(f"{changed.count(False)} of {len(changed)} parameters did not change: nothing trained")


def snapshot(model: Any) -> List[Any]:
    return [p.detach().clone() for p in model.parameters()]


def trainer_trained(ns: Dict[str, Any], before: List[Any], epochs: float = None) -> None:
    state = ns["trainer"].state
    assert state.global_step > 0 and math.isfinite(state.log_history[-1]["train_loss"])
    assert epochs is None or state.epoch == epochs, state.epoch
    assert ns["trainer"].odb_step_infos, "the trainer did not train on odb batches"
    trained(before, ns["trainer"].model)


# ---- README ----------------------------------------------------------------------------------------------------
def plain_loop() -> Fixture:
    ns = lm_world()
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        assert math.isfinite(float(ns["loss"])) and ns["info"].world_size == 1
        assert ns["loader"].odb_stats["samples"] == len(ns["dataset"])
        trained(before, ns["model"])

    return ns, check


# ---- the HF Trainer -----------------------------------------------------------------------------------------
def hf_trainer() -> Fixture:
    world = lm_world()
    ns = dict(model=world["model"], ds=world["dataset"], collator=world["collate_fn"])
    before = snapshot(ns["model"])
    return ns, lambda ns: trainer_trained(ns, before, epochs=2)


def hf_collator_options() -> Fixture:
    tokenizer = tiny_tokenizer()
    dataset = [{"input_ids": ids} for ids in tokenizer(texts())["input_ids"]]

    def check(ns: Dict[str, Any]) -> None:
        import odb

        loader = ns["token_budget_loader"](dataset, tokenizer)
        seen = []
        for batch in loader:
            info = odb.pop_step_info(batch)
            assert batch["input_ids"].numel() <= 16384
            # the collator's labels (pad masked, the causal shift) hold the tokens odb counted
            assert int((batch["labels"][:, 1:] != -100).sum()) == info.local_loss_tokens
            seen += info.sample_ids
        assert sorted(seen) == list(range(len(dataset)))

    return {}, check


def hf_trainer_auto() -> Fixture:
    from transformers import TrainingArguments

    world = lm_world()
    ns = dict(model=world["model"], ds=world["dataset"], collator=world["collate_fn"],
              args=TrainingArguments("out", num_train_epochs=1, use_cpu=True, report_to="none", save_strategy="no"))
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        trainer_trained(ns, before)
        assert ns["trainer"].odb_config.auto and ns["trainer"].odb_loader.odb_stats["auto_window_budget"] > 0

    return ns, check


def vlm_world() -> Dict[str, Any]:
    """A float32 tiny Qwen2-VL (random weights, from a config), its processor, processed samples and a collate."""
    from odb.bench import vlm_data as V

    return dict(model=V.build_model("qwen2_vl", seed=0), processor=V.build_processor("qwen2_vl"),
                samples=V.vlm_samples("qwen2_vl", 16, seed=0), collate=V.pad_collate)


def vlm_trained(ns: Dict[str, Any], before: List[Any]) -> None:
    """The trainer trained on odb batches; most parameters changed (a tower a step without images leaves alone)."""
    state = ns["trainer"].state
    assert state.global_step > 0 and math.isfinite(state.log_history[-1]["train_loss"])
    assert ns["trainer"].odb_step_infos, "the trainer did not train on odb batches"
    changed = [not a.equal(b) for a, b in zip(before, ns["trainer"].model.parameters())]
    assert sum(changed) > len(changed) // 2, f"{changed.count(False)} of {len(changed)} parameters did not change"


def hf_trainer_vlm() -> Fixture:
    world = vlm_world()
    ns = dict(model=world["model"], samples=world["samples"], collate=world["collate"])
    before = snapshot(ns["model"])
    return ns, lambda ns: vlm_trained(ns, before)


# ---- TRL ---------------------------------------------------------------------------------------------------
def trl_sft() -> Fixture:
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    ns = dict(tokenizer=tokenizer, model=tiny_llama(tokenizer), dataset=Dataset.from_dict({"text": texts()}))
    before = snapshot(ns["model"])
    return ns, lambda ns: trainer_trained(ns, before, epochs=2)


def trl_dpo() -> Fixture:
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    prompts, answers = texts(24, seed=1), texts(48, seed=2)
    pairs = Dataset.from_dict({"prompt": prompts, "chosen": [" " + a for a in answers[:24]],
                               "rejected": [" " + a for a in answers[24:]]})
    ns = dict(tokenizer=tokenizer, model=tiny_llama(tokenizer), ref_model=tiny_llama(tokenizer, seed=1), pairs=pairs)
    before = snapshot(ns["model"])
    return ns, lambda ns: trainer_trained(ns, before)


def trl_grpo() -> Fixture:
    from datasets import Dataset

    tokenizer = tiny_tokenizer()

    def reward(completions: List[str], **_: Any) -> List[float]:
        return [float(len(set(c.split()))) - 0.3 * len(c.split()) for c in completions]

    prompts = Dataset.from_dict({"prompt": [" ".join(t.split()[:1 + i % 6]) for i, t in enumerate(texts(16))]})
    ns = dict(tokenizer=tokenizer, model=tiny_llama(tokenizer), reward=reward, prompts=prompts)
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        trainer = ns["trainer"]
        assert trainer.state.global_step > 0 and math.isfinite(trainer.state.log_history[-1]["train_loss"])
        assert trainer.odb_rl.counts.micro_steps > 0, "odb cut no policy update into micro-batches"
        trained(before, trainer.model)

    return ns, check


def trl_auto() -> Fixture:
    import torch
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    tokenizer = tiny_tokenizer()
    model = tiny_llama(tokenizer)
    args = SFTConfig("out", num_train_epochs=1, use_cpu=not torch.cuda.is_available(), report_to="none",
                     save_strategy="no")
    ns = dict(trainer=SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts()}),
                                 processing_class=tokenizer))
    before = snapshot(model)

    def check(ns: Dict[str, Any]) -> None:
        trainer_trained(ns, before)
        assert ns["trainer"].odb_config.auto

    return ns, check


def trl_vlm() -> Fixture:
    import datasets
    from vlm_workers import raw_chats

    world = vlm_world()
    ns = dict(vlm=world["model"], processor=world["processor"], image_chats=datasets.Dataset.from_list(raw_chats(12)))
    before = snapshot(ns["vlm"])
    return ns, lambda ns: vlm_trained(ns, before)


# ---- Accelerate ----------------------------------------------------------------------------------------------
def accelerate_loop() -> Fixture:
    ns = lm_world()
    ns["epochs"] = 2
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        assert type(ns["loader"]).__name__ == "ODBAcceleratedLoader"
        assert ns["loader"].odb_stats["samples"] == len(ns["dataset"])
        trained(before, ns["model"])

    return ns, check


def accelerate_interrupted(ckpt: str = None) -> Tuple[Dict[str, Any], List[List[int]]]:
    """An Accelerator loop stopped after the first of its first epoch's 3 optimizer steps (one micro-batch each),
    saved to ``ckpt`` when given, with the loader the resume snippet builds; and the sample ids of the batches it
    had not trained yet."""
    import odb
    from accelerate import Accelerator
    from odb.integrations.accelerate import configure_accelerator

    ns = lm_world()
    dataset, accelerator = ns["dataset"], Accelerator(gradient_accumulation_steps=2)
    loader = configure_accelerator(accelerator, odb.ODBDataLoader(
        dataset, batch_size=8, sampler=odb.ShardSampler(dataset), gradient_accumulation_steps=2, token_budget=16384,
        shift_labels=True, collate_fn=ns["collate_fn"]))
    model, optimizer, loader = accelerator.prepare(ns["model"], ns["optimizer"], loader)
    batches = iter(loader)
    odb.pop_step_info(next(batches))
    if ckpt is not None:
        accelerator.save_state(ckpt)
    rest = [list(odb.pop_step_info(b).sample_ids) for b in batches]
    ns.update(accelerator=accelerator, model=model, optimizer=optimizer, loader=loader)
    return ns, rest


def accelerate_save() -> Fixture:
    ns, _ = accelerate_interrupted()

    def check(ns: Dict[str, Any]) -> None:
        assert any("custom_checkpoint" in name for name in os.listdir("ckpt")), os.listdir("ckpt")

    return ns, check


def accelerate_resume() -> Fixture:
    import odb
    from accelerate import Accelerator

    _, rest = accelerate_interrupted("ckpt")  # the interrupted run; the restarted one gets a new Accelerator
    fresh = lm_world()
    ns = dict(accelerator=Accelerator(gradient_accumulation_steps=2), model=fresh["model"],
              optimizer=fresh["optimizer"], dataset=fresh["dataset"], collate_fn=fresh["collate_fn"])

    def check(ns: Dict[str, Any]) -> None:
        assert len(rest) == 2  # two of the epoch's three optimizer steps
        assert [list(odb.pop_step_info(b).sample_ids) for b in ns["loader"]] == rest, "it did not continue the epoch"

    return ns, check


def accelerate_auto() -> Fixture:
    from accelerate import Accelerator

    world = lm_world()
    ns = dict(ds=world["dataset"], model=world["model"], optimizer=world["optimizer"], cap=2_000_000,
              collate_fn=world["collate_fn"], accelerator=Accelerator())

    def check(ns: Dict[str, Any]) -> None:
        import odb

        loader = ns["loader"]
        assert type(loader).__name__ == "ODBAcceleratedLoader" and loader.loader.odb_config.auto
        batches = [odb.pop_step_info(b) for b in loader]
        assert sum(i.local_samples for i in batches) == len(ns["ds"])

    return ns, check


# ---- Lightning ---------------------------------------------------------------------------------------------
def lightning_fit() -> Fixture:
    ns = lm_world()
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        trainer = ns["trainer"]
        loader = trainer.train_dataloader.loader
        assert trainer.current_epoch == 2 and trainer.global_step == 2 * loader.odb_optimizer_steps == 2 * 3
        assert trainer.accumulate_grad_batches == 2  # given back
        trained(before, ns["model"])

    return ns, check


def lightning_manual() -> Fixture:
    ns = lm_world()
    before = snapshot(ns["model"])

    return ns, lambda ns: trained(before, ns["model"])


# ---- LLaMA-Factory -------------------------------------------------------------------------------------------
def llamafactory_config() -> Dict[str, Any]:
    """An SFT config as LLaMA-Factory's examples write them (warmup_ratio, gradient checkpointing on), offline."""
    sys.path.insert(0, str(ROOT / "examples"))
    from llamafactory_sft import write_demo

    args = write_demo(os.getcwd())
    for name in ("disable_gradient_checkpointing", "use_cpu", "disable_tqdm"):
        args.pop(name)
    args.update(lr_scheduler_type="cosine", warmup_ratio=0.1, output_dir="saves/tiny-llama/sft")
    return args


def llamafactory_logged(ns: Dict[str, Any]) -> None:
    import json

    with open("saves/tiny-llama/sft/trainer_state.json") as f:
        history = json.load(f)["log_history"]
    losses = [h["loss"] for h in history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    assert all("odb_mean_batch_size" in h for h in history if "loss" in h)


def llamafactory_run_exp() -> Fixture:
    import yaml

    with open("my_sft.yaml", "w") as f:
        yaml.safe_dump(llamafactory_config(), f)
    return {}, llamafactory_logged


def llamafactory_neat_packing() -> Fixture:
    return {"args": {**llamafactory_config(), "neat_packing": True}}, llamafactory_logged


def llamafactory_parts() -> Fixture:
    """What LLaMA-Factory's run_sft builds before its trainer: model, training_args, collator, dataset_module..."""
    import torch

    from odb.integrations.llamafactory import import_llamafactory

    import_llamafactory()  # before load_model: its gradient checkpointing (on here) needs the transformers 5 fix
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer

    config = {**llamafactory_config(), "use_cpu": True, "disable_tqdm": True}
    config.pop("warmup_ratio")  # run_exp translates it; get_train_args is LLaMA-Factory's own parser
    model_args, data_args, training_args, finetuning_args, _ = get_train_args(config)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    dataset_module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    model = load_model(tokenizer_module["tokenizer"], model_args, finetuning_args, training_args.do_train)
    collator = SFTDataCollatorWith4DAttentionMask(template=template, model=model, pad_to_multiple_of=8,
                                                  label_pad_token_id=-100, **tokenizer_module)
    ns = dict(model=model, training_args=training_args, finetuning_args=finetuning_args, collator=collator,
              dataset_module=dataset_module, tokenizer_module=tokenizer_module,
              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    before = snapshot(model)

    def check(ns: Dict[str, Any]) -> None:
        if "trainer" in ns:
            trainer_trained(ns, before)
        else:
            assert ns["handle"].loader.odb_stats["samples"] == len(dataset_module["train_dataset"])
            trained(before, model)

    return ns, check


def readme_trainer() -> Fixture:
    """README's one call: ``trainer`` is a transformers Trainer built without odb."""
    from transformers import Trainer, TrainingArguments

    world = lm_world()
    args = TrainingArguments("out", num_train_epochs=1, per_device_train_batch_size=4, use_cpu=True,
                             report_to="none", disable_tqdm=True, save_strategy="no")
    ns = dict(trainer=Trainer(model=world["model"], args=args, train_dataset=world["dataset"],
                              data_collator=world["collate_fn"]))
    before = snapshot(world["model"])

    def check(ns: Dict[str, Any]) -> None:
        state = ns["trainer"].state
        assert state.global_step > 0 and math.isfinite(state.log_history[-1]["train_loss"])
        assert ns["trainer"].odb_step_infos, "the trainer did not train on odb batches"
        trained(before, world["model"])

    return ns, check


FIXTURES: Dict[str, Callable[[], Fixture]] = {
    "readme-quickstart": plain_loop,
    "readme-trainer": readme_trainer,
    "hf-trainer": hf_trainer,
    "hf-collator-options": hf_collator_options,
    "hf-trainer-auto": hf_trainer_auto,
    "hf-trainer-vlm": hf_trainer_vlm,
    "trl-sft": trl_sft,
    "trl-dpo": trl_dpo,
    "trl-auto": trl_auto,
    "trl-grpo": trl_grpo,
    "trl-vlm": trl_vlm,
    "llamafactory-run-exp": llamafactory_run_exp,
    "llamafactory-trainer": llamafactory_parts,
    "llamafactory-loop": llamafactory_parts,
    "llamafactory-neat-packing": llamafactory_neat_packing,
    "accelerate-loop": accelerate_loop,
    "accelerate-save": accelerate_save,
    "accelerate-resume": accelerate_resume,
    "accelerate-auto": accelerate_auto,
    "lightning-fit": lightning_fit,
    "lightning-manual": lightning_manual,
}
