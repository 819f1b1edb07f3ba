"""token_budget="auto" through the integrations: rank workers of tests/integrations/test_auto_integrations.py.

Each worker trains one epoch of a tiny random-weight model with ``token_budget="auto"`` under a
memory cap several times the first batches' activation memory, so the budget must grow. Every
step's activation memory is recorded by a ``Recording`` meter around the loader's meter (the
meter the integration defaulted to for the HF Trainer and TRL; the user's for Accelerate and
Lightning), so the test sees exactly what the loader measured. HF, TRL and Accelerate workers run
under dist_harness (``run_ranks("auto_integration_workers:<fn>", ...)``) or, for one process, in the
test process.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional

import torch

import odb
from odb.train.memory import ActivationMeter


class Recording:
    """A meter that returns ``meter()`` and keeps every value it measured (None: no forward ran)."""

    def __init__(self, meter: Callable[[], Optional[float]]) -> None:
        self.meter = meter
        self.values: List[float] = []

    def __call__(self) -> Optional[float]:
        value = self.meter()
        if value is not None:
            self.values.append(float(value))
        return value


def summary(stats: Dict[str, Any], peaks: List[float], infos: List[Any], losses: List[float]) -> Dict[str, Any]:
    """What every test checks, as plain values: steps, auto counters, measured peaks, batch tokens, losses."""
    return {"steps": len(infos), "ghosts": sum(bool(i.is_ghost) for i in infos),
            "padded": [int(i.padded_tokens) for i in infos], "samples": sorted(s for i in infos for s in i.sample_ids),
            "window_budget": stats.get("auto_window_budget"), "observed": stats.get("auto_observed_steps"),
            "auto_cap": stats.get("auto_cap"), "peaks": peaks, "losses": losses}


# ---- HF Trainer and TRL -------------------------------------------------------------------------------


def _trainer_run(trainer: Any) -> Dict[str, Any]:
    """Train ``trainer`` (odb enabled, "auto"), its loader's meter wrapped in a Recording; the summary."""
    from transformers import TrainerCallback

    run = trainer._odb
    defaulted = type(run.cfg.memory_meter).__name__
    recording = Recording(run.cfg.memory_meter)
    run.cfg = run.cfg.replace(memory_meter=recording)  # the loader train() builds measures through it
    infos: List[Any] = []

    class Steps(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            infos.extend(trainer.odb_step_infos)

    trainer.add_callback(Steps())
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    out = summary(trainer.odb_loader.odb_stats, recording.values, infos, losses)
    out.update(default_meter=defaulted, global_step=trainer.state.global_step,
               relative_error=trainer.odb_loader.odb_stats.get("auto_memory_relative_error"))
    return out


LOG_EVERY_STEP = dict(logging_strategy="steps", logging_steps=1)  # the loss of every step in log_history


def _auto_trainer(rank: int, world: int, p: Dict[str, Any], build: Callable[[Dict[str, Any], str], Any],
                  **fields: Any) -> Dict[str, Any]:
    """One epoch of ``build``'s trainer with token_budget="auto" and no memory_meter (the integration's default)."""
    import hf_workers as H

    if world > 1:
        H._join_torch_distributed(rank, world)
    q = dict(n=p["n"], ga=p.get("ga", 1), lr=1e-2, budget="auto", max_steps=-1, epochs=1, args=LOG_EVERY_STEP,
             odb=dict(memory_cap_bytes=p["cap"], auto_start_budget=p["start"]), buffer=p["buffer"], **fields)
    return _trainer_run(build(q, p["out"]))


def hf_auto(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """The HF Trainer (ODBTrainer) over a tiny Llama."""
    import hf_workers as H

    return _auto_trainer(rank, world, p, H.build_trainer, model="llama")


def trl_auto(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """TRL's SFTTrainer (its own data preparation and collator) over a tiny Llama."""
    import trl_workers as T

    return _auto_trainer(rank, world, p, T.build_trainer, kind="text")


def hf_refusals(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, str]:
    """What enable_odb says for "auto" without memory_cap_bytes on CPU, and which meter it defaults to."""
    from transformers import Trainer

    import hf_workers as H
    from odb.integrations.hf import enable_odb

    q = dict(model="llama", n=8, ga=1, lr=1e-3, budget="auto", max_steps=1)
    out: Dict[str, str] = {}
    try:
        enable_odb(Trainer(model=H.make_model(q), args=H.make_args(q, p["out"]), train_dataset=H.dataset_for(q),
                           data_collator=H.pad_collate), token_budget="auto")
    except ValueError as err:
        out["no_cap"] = str(err)
    mine = Recording(lambda: None)
    trainer = enable_odb(Trainer(model=H.make_model(q), args=H.make_args(q, p["out"]), train_dataset=H.dataset_for(q),
                                 data_collator=H.pad_collate), token_budget="auto", memory_cap_bytes=10**6,
                         memory_meter=mine)
    out["kept"] = str(trainer.odb_config.memory_meter is mine)
    trainer = enable_odb(Trainer(model=H.make_model(q), args=H.make_args(q, p["out"]), train_dataset=H.dataset_for(q),
                                 data_collator=H.pad_collate), token_budget=64)
    out["int_budget"] = repr(trainer.odb_config.memory_meter)
    return out


# ---- Accelerate --------------------------------------------------------------------------------------


def accelerate_auto(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """An Accelerate loop (prepare, accumulate, backward) over a loader with token_budget="auto"."""
    from dist_workers import lm_loss, lm_model
    from helpers import LengthDataset, pad_collate
    from integration_workers import _accelerator

    from odb.integrations.accelerate import configure_accelerator, scale_loss

    accelerator = _accelerator(rank, world, 1)
    ds = LengthDataset(p["lengths"])
    model = lm_model(p["seed"])
    recording = Recording(ActivationMeter(model))  # the user's line: the loader is built before prepare
    loader = odb.ODBDataLoader(ds, token_budget="auto", memory_cap_bytes=p["cap"], memory_meter=recording,
                               auto_start_budget=p["start"], sampler=odb.ShardSampler(ds, seed=3),
                               buffer_size=p["buffer"], collate_fn=pad_collate, seed=0)
    opt = torch.optim.SGD(model.parameters(), lr=p["lr"])
    model, opt, prepared = accelerator.prepare(model, opt, configure_accelerator(accelerator, loader))
    infos, losses = [], []
    prepared.set_epoch(0)
    for batch in prepared:
        with accelerator.accumulate(model):
            info = odb.pop_step_info(batch)
            loss = lm_loss(model, batch)
            accelerator.backward(scale_loss(accelerator, loss, info))
            opt.step()
            opt.zero_grad()
        infos.append(info)
        if not info.is_ghost:
            losses.append(float(loss.detach()))
    return summary(prepared.odb_stats, recording.values, infos, losses)


def finite(values: List[float]) -> bool:
    return bool(values) and all(math.isfinite(v) for v in values)
