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
