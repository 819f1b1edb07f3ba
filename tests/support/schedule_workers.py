"""The same Trainer run with and without odb (the user's batch), for tests/integrations/test_hf_schedule.py.

``run(rank, world, p)`` trains a float64 tiny Llama with transformers' ``Trainer`` (``p["trainer"] == "hf"``)
or TRL's ``SFTTrainer`` (``"sft"``), with ``enable_odb`` when ``p["odb"]`` and as it is otherwise, and
returns what the two must share: the learning rate after every optimizer step, the parameters at the end,
the step count. The data is read in order (``train_sampling_strategy="sequential"``), so each optimizer step
of the plain Trainer and of odb holds the same samples (odb only cuts them into other micro-batches), and
the gradient is the exact token mean of the step either way. The same function runs on every rank of
dist_harness.run_ranks ("schedule_workers:run") and in the test process for one rank.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import torch

import hf_workers as H

LR = 1e-2


def trainer_args(p: Dict[str, Any], out: str) -> Dict[str, Any]:
    """TrainingArguments (or SFTConfig) fields shared by both runs: plain SGD, so the update is lr x gradient."""
    options = dict(output_dir=out, use_cpu=True, report_to="none", disable_tqdm=True, optim="sgd", learning_rate=LR,
                   weight_decay=0.0, max_grad_norm=0.0, per_device_train_batch_size=p.get("batch", 4),
                   gradient_accumulation_steps=p.get("ga", 2), num_train_epochs=p.get("epochs", 2),
                   max_steps=p.get("max_steps", -1), train_sampling_strategy="sequential", save_strategy="no",
                   logging_strategy="no", seed=7, dataloader_num_workers=0)
    options.update(p.get("args", {}))
    return options


def build(p: Dict[str, Any], out: str) -> Any:
    """The Trainer of ``p``, with odb (the user's batch: no odb option but the budget) when ``p["odb"]``."""
    from transformers import Trainer, TrainingArguments

    model = H.llama()
    if p.get("trainer", "hf") == "sft":
        import trl_workers as T
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, args=SFTConfig(**trainer_args(p, out), bf16=False, dataset_num_proc=None),
                             train_dataset=T.raw_dataset("completion", p["n"]), processing_class=T.tokenizer())
    else:
        trainer = Trainer(model=model, args=TrainingArguments(**trainer_args(p, out)),
                          train_dataset=H.causal_dataset(p["n"]), data_collator=H.pad_collate)
    if p.get("odb"):
        from odb.integrations.hf import enable_odb

        enable_odb(trainer, token_budget=p.get("budget", 60), buffer_size=16)
    return trainer


def run(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Train per ``p``: the learning rate after each optimizer step, the final parameters, the step count."""
    if world > 1:
        H._join_torch_distributed(rank, world)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend (tenfold slower on a busy machine)
    try:
        return _train(p)
    finally:
        torch.set_num_threads(threads)


def _train(p: Dict[str, Any]) -> Dict[str, Any]:
    from transformers import TrainerCallback

    trainer = build(p, p["out"])
    rates: List[float] = []
    micro: List[int] = []  # odb: the micro-batches of each optimizer step on this rank

    class Rates(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rates.append(trainer.lr_scheduler.get_last_lr()[0])
            if p.get("odb"):
                micro.append(len(trainer.odb_step_infos))

    trainer.add_callback(Rates())
    before = {n: w.detach().clone() for n, w in trainer.model.named_parameters()}
    trainer.train(resume_from_checkpoint=p.get("resume"))
    return {"rates": rates, "global_step": trainer.state.global_step, "max_steps": trainer.state.max_steps,
            "before": before, "params": {n: w.detach().clone() for n, w in trainer.model.named_parameters()},
            "micro": micro}


def suite(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Several runs in one set of processes (the interpreter and transformers start once)."""
    return [run(rank, world, dict(r, out=os.path.join(p["out"], str(k)))) for k, r in enumerate(p["runs"])]


def update_gap(plain: Dict[str, Any], odb: Dict[str, Any]) -> float:
    """max |odb's update - the plain Trainer's| / max |the plain Trainer's| over all parameters (float64)."""
    start = plain["before"]
    ref = {n: plain["params"][n] - start[n] for n in start}
    scale = max(float(d.abs().max()) for d in ref.values())
    return max(float((odb["params"][n] - start[n] - ref[n]).abs().max()) for n in ref) / scale


def same_start(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    return all(torch.equal(a["before"][n], b["before"][n]) for n in a["before"])
