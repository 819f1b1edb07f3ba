"""Rank workers for tests/integrations/test_elastic_integrations.py: one phase of a job whose checkpoint,
saved by W processes, is resumed by a fresh set of W' processes (elastic resume).

Run on every rank by dist_harness.run_ranks as ``"elastic_integration_workers:<name>"``
(a fresh set of processes, gloo group up). Each phase trains with the real framework, records
the sample ids of every optimizer step on its rank, and may checkpoint with the
framework's own call (Accelerate's save_state; the HF Trainer's save_steps).
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch

import odb
from dist_workers import lm_loss, lm_model
from helpers import LengthDataset, pad_collate
from integration_workers import _accelerator


def accelerate_phase(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Accelerate: load_state(p["load_from"]) if given, train until p["stop"] optimizer steps (then
    save_state(p["save_to"])) or to the end of epoch 0 and through epoch 1; record every step."""
    from odb.integrations.accelerate import configure_accelerator, scale_loss

    accelerator = _accelerator(rank, world, p["accumulation"])
    ds = LengthDataset(p["lengths"])
    loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=odb.ShardSampler(ds, seed=3),
                               buffer_size=p["buffer"], collate_fn=pad_collate, seed=0,
                               gradient_accumulation_steps=p["accumulation"])
    model = lm_model(p["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=p["lr"])
    model, opt, prepared = accelerator.prepare(model, opt, configure_accelerator(accelerator, loader))
    if p.get("load_from"):
        accelerator.load_state(p["load_from"])
        epochs = [None, 1]  # None: the resumed epoch, where the loader's state put it
    else:
        epochs = [0, 1]
    steps: List[Dict[str, Any]] = []
    for epoch in epochs:
        if epoch is not None:
            prepared.set_epoch(epoch)
        ids: List[int] = []
        scales: List[float] = []
        for batch in prepared:
            with accelerator.accumulate(model):
                info = odb.pop_step_info(batch)
                ids += [] if info.is_ghost else list(batch["idx"])
                scales.append(info.loss_scale)
                accelerator.backward(scale_loss(accelerator, lm_loss(model, batch), info))
                opt.step()
                opt.zero_grad()
            if accelerator.sync_gradients:
                steps.append({"epoch": info.epoch, "step": info.micro_batch, "ids": ids, "scale": sum(scales)})
                ids, scales = [], []
                if len(steps) == p.get("stop"):
                    accelerator.save_state(p["save_to"])  # every rank calls it; the main process writes
                    return {"steps": steps}
    return {"steps": steps}


def hf_phase(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """The HF Trainer (hf_workers.train_ranks): train, checkpointing every save_steps, or resume from
    p["resume"]; the steps it records are (global_step, epoch, this rank's sample ids, lr)."""
    import hf_workers

    out = hf_workers.train_ranks(rank, world, p)
    return {"steps": out["steps"], "global_step": out["global_step"]}
