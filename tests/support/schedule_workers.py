"""The same Trainer run with and without odb (the user's batch), for tests/integrations/test_hf_schedule.py
and test_hf_sampling.py.

``run(rank, world, p)`` trains a float64 tiny Llama with transformers' ``Trainer`` (``p["trainer"] == "hf"``),
a tiny T5 with its ``Seq2SeqTrainer`` (``"seq2seq"``) or a Llama with TRL's ``SFTTrainer`` (``"sft"``), with
``enable_odb`` when ``p["odb"]`` and as it is otherwise, and returns what the two must share: the learning
rate after every optimizer step, the parameters at the end, the step count, torch's global RNG state at the
end. By default the data is read in order (``train_sampling_strategy="sequential"``), so each optimizer step
of the plain Trainer and of odb holds the same samples (odb only cuts them into other micro-batches), and
the gradient is the exact token mean of the step either way. ``p["packed"]``: odb trains on its packed rows
(``odb.PackedCollate``) where the plain Trainer pads; ``p["known"]``: odb is given the samples' lengths. The
same function runs on every rank of dist_harness.run_ranks ("schedule_workers:run") and in the test process
for one rank.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import torch

import hf_workers as H
import odb

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

    kind = p.get("trainer", "hf")
    model = H.t5() if kind == "seq2seq" else H.llama()
    if kind == "sft":
        import trl_workers as T
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, args=SFTConfig(**trainer_args(p, out), bf16=False, dataset_num_proc=None),
                             train_dataset=T.raw_dataset("completion", p["n"]), processing_class=T.tokenizer())
    elif kind == "seq2seq":
        from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments

        trainer = Seq2SeqTrainer(model=model, args=Seq2SeqTrainingArguments(**trainer_args(p, out)),
                                 train_dataset=H.seq2seq_dataset(p["n"]), data_collator=H.pad_collate)
    else:
        packed = p.get("odb") and p.get("packed")  # odb's packed rows against the plain Trainer's padded ones
        trainer = Trainer(model=model, args=TrainingArguments(**trainer_args(p, out)),
                          train_dataset=H.causal_dataset(p["n"]),
                          data_collator=odb.PackedCollate() if packed else H.pad_collate)
    if p.get("odb"):
        from odb.integrations.hf import enable_odb

        known = [len(s["input_ids"]) for s in trainer.train_dataset] if p.get("known") else None
        enable_odb(trainer, token_budget=p.get("budget", 60), buffer_size=16, lengths=known,
                   **({"layout": "packed"} if p.get("packed") else {}))
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
            "micro": micro, "rng": torch.get_rng_state()}  # torch's global RNG once trained


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


def refusals(rank: int, world: int, p: Dict[str, Any]) -> List[str]:
    """The message ``enable_odb`` refuses each of ``p["args"]`` (TrainingArguments changes) with ("" if none)."""
    H._join_torch_distributed(rank, world)
    out = []
    for k, args in enumerate(p["args"]):
        try:
            build(dict(n=16, args=args, odb=True), os.path.join(p["out"], str(k)))
            out.append("")
        except ValueError as err:
            out.append(str(err))
    return out
