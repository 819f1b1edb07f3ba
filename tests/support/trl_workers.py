"""TRL SFTTrainer runs with odb, shared by tests/integrations/test_trl.py and its 2-process runs.

``train_ranks`` runs on every rank of dist_harness.run_ranks ("trl_workers:suite_ranks");
the same function runs in the test process for one rank. Everything is offline: the
tokenizer is a WordLevel model trained on generated sentences (examples/_hf_text.py)
with a chat template that marks the assistant's turns, the model a float64 tiny Llama
from a config (tests/support/hf_workers.py). TRL prepares the data itself (tokenization,
``completion_mask``, ``assistant_masks``, and from TRL 1.9 the ``labels`` built from them).

The reference of an optimizer step is computed in one process, one sample at a time:
labels from TRL's collator applied to that sample alone, the causal shift, then
(sum of per-token losses) / (their count) over the samples of the step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import hf_workers as H  # noqa: E402
from _hf_text import sentences, train_tokenizer  # noqa: E402

IGNORE = -100
# Each turn is "<role> : <content>"; the assistant's content and its </s> are the generation part
# (what assistant_only_loss trains on).
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }} : {% if m['role'] == 'assistant' %}{% generation %}"
                 "{{ m['content'] }} </s>{% endgeneration %} {% else %}{{ m['content'] }} {% endif %}{% endfor %}"
                 "{% if add_generation_prompt %}assistant : {% endif %}")


def tokenizer() -> Any:
    tok = train_tokenizer(sentences(200, seed=1) + ["user assistant :"])
    tok.chat_template = CHAT_TEMPLATE
    return tok


def raw_dataset(kind: str, n: int, seed: int = 0) -> Any:
    """A ``datasets.Dataset`` as a user hands it to SFTTrainer: text, prompt-completion or conversations."""
    from datasets import Dataset

    texts = sentences(n, seed=seed, low=2, high=18)
    if kind == "text":
        return Dataset.from_dict({"text": texts})
    halves = [(" ".join(t.split()[:max(1, len(t.split()) // 3)]), " ".join(t.split()[max(1, len(t.split()) // 3):])
               or "the") for t in texts]
    if kind == "completion":
        return Dataset.from_dict({"prompt": [p for p, _ in halves], "completion": [" " + c for _, c in halves]})
    if kind == "assistant":
        return Dataset.from_dict({"messages": [[{"role": "user", "content": p}, {"role": "assistant", "content": c},
                                                {"role": "user", "content": c.split()[0]},
                                                {"role": "assistant", "content": p}] for p, c in halves]})
    raise ValueError(f"unknown dataset kind {kind!r}")


def sft_config(p: Dict[str, Any], out: str) -> Any:
    from trl import SFTConfig

    options = dict(output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, bf16=False, optim="sgd",
                   learning_rate=p.get("lr", 1e-3), weight_decay=0.0, max_grad_norm=0.0,
                   lr_scheduler_type="constant", gradient_accumulation_steps=p.get("ga", 1),
                   max_steps=p.get("max_steps", -1), num_train_epochs=p.get("epochs", 1), save_strategy="no",
                   logging_strategy="no", seed=7, dataloader_num_workers=p.get("workers", 0),
                   padding_free=p.get("padding_free", False), assistant_only_loss=p["kind"] == "assistant",
                   dataset_num_proc=None)
    options.update(p.get("args", {}))
    if options["padding_free"]:  # TRL >= 1.0 refuses padding_free without packing unless max_length=None
        options.setdefault("max_length", None)
    return SFTConfig(**options)


def build_trainer(p: Dict[str, Any], out: str) -> Any:
    """An SFTTrainer over ``p['kind']`` data, switched to odb with ``p['budget']`` (and ``p['odb']``)."""
    import warnings

    from trl import SFTTrainer

    from odb.integrations.trl import enable_odb

    model = H.llama(p.get("model_seed", 0))
    if p.get("no_loss_kwargs"):  # as transformers' models that declare it: the Trainer's loss rules differ
        model.accepts_loss_kwargs = False
    if p.get("attn"):  # e.g. "odb_varlen"
        import odb

        model.set_attn_implementation(odb.register_varlen_attention() if p["attn"] == "odb_varlen" else p["attn"])
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Pp]adding-free.*")  # TRL's advice for flash attention
        trainer = SFTTrainer(model=model, args=sft_config(p, out),
                             train_dataset=raw_dataset(p["kind"], p["n"], p.get("data_seed", 0)),
                             processing_class=tokenizer())
    options = dict(token_budget=p["budget"], buffer_size=p.get("buffer", 16))
    if not p.get("same_updates"):  # these runs test budget-filled steps, the explicit choice
        options["global_batch_size"] = None
    options.update(p.get("odb", {}))
    if p.get("known_lengths"):
        options["lengths"] = [len(ids) for ids in trainer.train_dataset["input_ids"]]
    return enable_odb(trainer, **options)


def reference(trainer: Any, ids: Sequence[int], lr: float) -> Dict[str, Any]:
    """-lr x gradient of (sum of token losses) / (their count) over the samples ``ids``, and that count.

    Labels of each sample come from the trainer's own collator applied to it alone (a row
    without padding), and the loss drops the first label as the model's does.
    """
    model = H.llama(0)
    total, tokens = torch.zeros((), dtype=torch.float64), 0
    for i in ids:
        batch = trainer.data_collator([trainer.train_dataset[int(i)]])
        logits = model(input_ids=batch["input_ids"]).logits[0][:-1]
        labels = batch["labels"][0][1:]
        keep = labels != IGNORE
        total = total + F.cross_entropy(logits[keep].double(), labels[keep], reduction="sum")
        tokens += int(keep.sum())
    (total / tokens).backward()
    return {"delta": {n: -lr * w.grad for n, w in model.named_parameters() if w.grad is not None},
            "tokens": tokens}


def train_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Train per ``p``; this rank's parameter change, last step's infos, steps and collated row counts
    (the rows are counted in this process: with ``workers`` > 0 they stay empty)."""
    if world > 1:
        H._join_torch_distributed(rank, world)
    trainer = build_trainer(p, p["out"])
    rec = H.recorder(trainer)
    rows: List[int] = []
    collate = trainer.data_collator

    def counting(samples: List[Any]) -> Any:  # the rows of each collated batch (1 for padding-free)
        batch = collate(samples)
        rows.append(int(batch["input_ids"].shape[0]))
        return batch

    trainer.data_collator = counting
    forwards: List[int] = []  # calls of the model itself (TRL's fused forward included), per micro-batch
    hook = trainer.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    before = {n: w.detach().clone() for n, w in trainer.model.named_parameters()}
    trainer.train(resume_from_checkpoint=p.get("resume"))
    hook.remove()
    trainer.data_collator = collate
    return {"forwards": len(forwards), "accepts_loss_kwargs": trainer.model_accepts_loss_kwargs,"delta": {n: w.detach() - before[n] for n, w in trainer.model.named_parameters()},
            "infos": [i.as_dict() for i in trainer.odb_step_infos], "steps": rec.steps, "rows": rows,
            "ids": sorted(i for info in trainer.odb_step_infos for i in info.sample_ids),
            "global_step": trainer.state.global_step, "epoch": trainer.state.epoch,
            "layout": trainer.odb_config.layout, "budget": p["budget"],
            "params": {n: w.detach().clone() for n, w in trainer.model.named_parameters()}}


def suite_ranks(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Several runs in one set of processes (the interpreter, transformers and TRL start once)."""
    return [train_ranks(rank, world, dict(run, out=os.path.join(p["out"], str(k))) if "out" not in run else run)
            for k, run in enumerate(p["runs"])]


# ---- TRL's preference trainers (tests/integrations/test_trl_preference.py) ------------------------------


def pair_dataset(n: int, seed: int = 0) -> Any:
    """``n`` preference pairs as a user hands them to DPOTrainer / RewardTrainer: prompt, chosen, rejected text of
    varied lengths (the rejected answer is another sentence, so the pair's two rows differ in length)."""
    from datasets import Dataset

    texts = sentences(2 * n, seed=seed, low=2, high=18)
    words = [t.split() for t in texts[:n]]
    cut = [max(1, len(w) // 3) for w in words]
    return Dataset.from_dict({"prompt": [" ".join(w[:c]) for w, c in zip(words, cut)],
                              "chosen": [" " + (" ".join(w[c:]) or "the") for w, c in zip(words, cut)],
                              "rejected": [" " + t for t in texts[n:]]})


def reward_model(seed: int = 0) -> torch.nn.Module:
    """A float64 tiny Llama with a one-output score head (what RewardTrainer trains)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=H.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64, num_labels=1,
                      pad_token_id=0, attn_implementation="eager")
    return LlamaForSequenceClassification(cfg).to(torch.float64)


def pair_trainer(p: Dict[str, Any], out: str, data: Any = None) -> Any:
    """A TRL DPOTrainer (``p['trainer'] == 'dpo'``) or RewardTrainer over ``pair_dataset`` (or ``data``), without odb.

    SGD without weight decay or clipping and a constant rate: one step changes the parameters by -lr x the
    gradient. ``p['args']`` overrides the config.
    """
    import warnings

    import trl

    options = dict(output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, bf16=False, optim="sgd",
                   learning_rate=p.get("lr", 1e-2), weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                   gradient_accumulation_steps=p.get("ga", 1), per_device_train_batch_size=p.get("per_device", 4),
                   max_steps=p.get("max_steps", 1), save_strategy="no", logging_strategy="no", seed=7,
                   dataset_num_proc=None, dataloader_num_workers=p.get("workers", 0))
    options.update(p.get("args", {}))
    data = data if data is not None else pair_dataset(p["n"], p.get("data_seed", 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*padding_free.*")  # TRL 1.x turns DPO's padding_free off
        models = [H.llama(0), H.llama(1)] if p["trainer"] == "dpo" else [reward_model(0)]
        for model in models:  # float64 throughout (eager attention takes its softmax in float32)
            model.set_attn_implementation("sdpa")
        if p["trainer"] == "dpo":
            return trl.DPOTrainer(model=models[0], ref_model=models[1], args=trl.DPOConfig(**options),
                                  train_dataset=data, processing_class=tokenizer())
        return trl.RewardTrainer(model=models[0], args=trl.RewardConfig(**options), train_dataset=data,
                                 processing_class=tokenizer())


def pair_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Train a preference trainer with odb (``p['budget']``, ``p['odb']``) on this rank; return the parameter
    change, the last step's infos and sample ids, each collated micro-batch's (pairs, input_ids shape), and the
    forward calls of the trained model (TRL's reference model is another module)."""
    from odb.integrations.hf import enable_odb

    if world > 1:
        H._join_torch_distributed(rank, world)
    trainer = enable_odb(pair_trainer(p, p["out"]), token_budget=p["budget"], buffer_size=p.get("buffer", 16),
                         **p.get("odb", {}))
    collate, shapes = trainer.data_collator, []

    def counting(samples: List[Any]) -> Any:
        batch = collate(samples)
        shapes.append((len(samples), tuple(batch["input_ids"].shape)))
        return batch

    trainer.data_collator = counting
    forwards: List[int] = []
    hook = trainer.model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    before = {n: w.detach().clone() for n, w in trainer.model.named_parameters()}
    trainer.train()
    hook.remove()
    return {"delta": {n: w.detach() - before[n] for n, w in trainer.model.named_parameters()},
            "infos": [i.as_dict() for i in trainer.odb_step_infos], "shapes": shapes, "forwards": len(forwards),
            "ids": sorted(i for info in trainer.odb_step_infos for i in info.sample_ids),
            "global_step": trainer.state.global_step, "loss_scaling": trainer.odb_config.loss_scaling,
            "pad_to_multiple_of": trainer.odb_config.pad_to_multiple_of}


def pair_suite(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Several ``pair_ranks`` runs in one set of processes."""
    return [pair_ranks(rank, world, dict(run, out=os.path.join(p["out"], str(k)))) for k, run in enumerate(p["runs"])]


def pair_reference(p: Dict[str, Any], ids: Sequence[int], out: str) -> Dict[str, torch.Tensor]:
    """The parameter change of one optimizer step of TRL's own trainer, without odb, over exactly the pairs
    ``ids`` in one process: ``p['ga']`` equal micro-batches of len(ids) / ga pairs (TRL's sampler and collator)."""
    ga = p.get("ga", 1)
    assert len(ids) % ga == 0, (len(ids), ga)
    data = pair_dataset(p["n"], p.get("data_seed", 0)).select([int(i) for i in ids])
    trainer = pair_trainer(dict(p, per_device=len(ids) // ga, max_steps=1), out, data=data)
    before = {n: w.detach().clone() for n, w in trainer.model.named_parameters()}
    trainer.train()
    assert trainer.state.global_step == 1
    return {n: w.detach() - before[n] for n, w in trainer.model.named_parameters()}
