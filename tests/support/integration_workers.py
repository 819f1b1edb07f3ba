"""Rank workers and models for the Accelerate and Lightning integration tests.

Accelerate workers run under dist_harness (``run_ranks("integration_workers:<fn>", ...)``):
the harness has joined a gloo group; the worker sets the environment variables that a
launcher would (Accelerate reads them to pick MULTI_CPU), builds ``Accelerator(cpu=True)``
on that group and returns plain values. With world 1 they run as a plain ``python train.py``
would: no process group, no launcher variables. The Lightning pieces (module, data, recorder)
are module-level so that ddp_spawn can pickle them by reference.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

import torch

import odb
from dist_workers import lm_loss, lm_model
from helpers import IGNORE, LengthDataset, make_sample, pad_collate

try:
    import lightning.pytorch as pl
except ImportError:  # the Lightning tests skip; the Accelerate workers do not need it
    pl = None


def reference_run(lengths: Sequence[int], steps: List[List[int]], seed: int, lr: float) -> List[List[torch.Tensor]]:
    """Parameters after each SGD step of one process whose step s sees the samples ``steps[s]``.

    The gradient of a step is that of (sum of per-token losses of its samples) / (their
    supervised tokens): what exact loss scaling promises over all ranks and micro-batches.
    """
    model = lm_model(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for ids in steps:
        batch = pad_collate([make_sample(i, lengths[i]) for i in ids])
        total = int((batch["labels"] != IGNORE).sum())
        opt.zero_grad()
        (lm_loss(model, batch, reduction="sum") / total).backward()
        opt.step()
        out.append([p.detach().clone() for p in model.parameters()])
    return out


# ---- Accelerate -------------------------------------------------------------------------------


def _accelerator(rank: int, world: int, accumulation: int) -> Any:
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    from accelerate import Accelerator

    return Accelerator(cpu=True, gradient_accumulation_steps=accumulation)


def accelerate_train(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """For each gradient_accumulation_steps: prepare, train p["epochs"] epochs, record every step."""
    from odb.integrations.accelerate import ODBAcceleratedLoader, configure_accelerator, scale_loss

    accelerator = _accelerator(rank, world, p["accumulation"][0])
    ds = LengthDataset(p["lengths"])
    out: Dict[str, Any] = {"num_processes": accelerator.num_processes, "runs": {},
                           "distributed_type": accelerator.distributed_type.value}
    for k in p["accumulation"]:
        accelerator.gradient_accumulation_steps = k
        # same_updates: the user's batch (3 per micro-batch, k micro-batches, every rank) in odb's micro-batches
        steps_of = {"global_batch_size": 3 * k * world} if p.get("same_updates") else \
            {"gradient_accumulation_steps": k}
        loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=odb.ShardSampler(ds, seed=3),
                                   buffer_size=p["buffer"], collate_fn=pad_collate, seed=0, **steps_of)
        model = lm_model(p["seed"])
        opt = torch.optim.SGD(model.parameters(), lr=p["lr"])
        wrapped = configure_accelerator(accelerator, loader)
        model, opt, prepared = accelerator.prepare(model, opt, wrapped)
        passed_through = prepared is wrapped and type(prepared) is ODBAcceleratedLoader
        epochs = []
        for epoch in range(p["epochs"]):
            prepared.set_epoch(epoch)
            micro, steps, ids = [], [], []
            for batch in prepared:
                with accelerator.accumulate(model):
                    info = odb.pop_step_info(batch)
                    ids += list(info.sample_ids)
                    accelerator.backward(scale_loss(accelerator, lm_loss(model, batch), info))
                    micro.append({"sync": accelerator.sync_gradients, "last": info.is_last_micro_step,
                                  "micro_steps": info.micro_steps, "ghost": info.is_ghost,
                                  "idx": list(batch["idx"]), "ids": list(info.sample_ids)})
                    opt.step()
                    opt.zero_grad()
                    if accelerator.sync_gradients:
                        steps.append({"ids": ids, "params": [q.detach().clone() for q in model.parameters()]})
                        ids = []
            epochs.append({"micro": micro, "steps": steps, "sampler_epoch": loader.sampler.epoch,
                           "sampler_order": list(loader.sampler)})
        out["runs"][k] = {"passed_through": passed_through, "epochs": epochs}
    return out


def accelerate_resume(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """skip_first_batches and save_state/load_state against an uninterrupted epoch; the wrapper's checks."""
    from odb.integrations import accelerate as odb_acc

    accelerator = _accelerator(rank, world, 1)
    ds = LengthDataset(p["lengths"])

    def build(**kw: Any) -> odb.ODBDataLoader:
        kw.setdefault("sampler", odb.ShardSampler(ds, seed=1))
        return odb.ODBDataLoader(ds, token_budget=p["budget"], buffer_size=p["buffer"], collate_fn=pad_collate,
                                 first_window_size=p["first_window"], seed=0, **kw)

    full = odb_acc.configure_accelerator(accelerator, build())
    full.set_epoch(1)
    reference = [list(odb.pop_step_info(b).sample_ids) for b in full]
    fresh = odb_acc.configure_accelerator(accelerator, build())
    fresh.set_epoch(1)
    skipped = [list(odb.pop_step_info(b).sample_ids) for b in odb_acc.skip_first_batches(fresh, p["skip"])]
    out: Dict[str, Any] = {"reference": reference, "skipped": skipped, "errors": {}}

    # odb's mid-epoch state through save_state/load_state; each Accelerator registers only its own loader
    saving = _accelerator(rank, world, 1)
    interrupted = odb_acc.configure_accelerator(saving, build())
    interrupted.set_epoch(1)
    for n, _ in enumerate(interrupted, 1):
        if n == p["skip"]:
            saving.save_state(p["checkpoint"])  # every rank calls it; the main process writes
            break
    saving.wait_for_everyone()  # rank 1 reads what rank 0 wrote
    loading = _accelerator(rank, world, 1)
    resumed = odb_acc.configure_accelerator(loading, build())
    loading.load_state(p["checkpoint"])
    out["resumed"] = [list(odb.pop_step_info(b).sample_ids) for b in resumed]

    def error(name: str, fn: Any) -> None:
        try:
            fn()
        except (TypeError, ValueError, AttributeError) as err:
            out["errors"][name] = f"{type(err).__name__}: {err}"

    error("accumulation", lambda: odb_acc.configure_accelerator(accelerator, build(gradient_accumulation_steps=2)))
    error("unsharded", lambda: odb_acc.configure_accelerator(  # a ShardSampler built before the process group
        accelerator, build(sampler=odb.ShardSampler(ds, num_replicas=1, rank=0))))
    error("not_odb", lambda: odb_acc.configure_accelerator(accelerator, torch.utils.data.DataLoader(ds)))
    error("accelerate_skip", lambda: accelerator.skip_first_batches(full, 2))
    return out


# ---- Lightning (ddp_spawn pickles these by reference) ---------------------------------------------


class LitLM(pl.LightningModule if pl is not None else object):  # type: ignore[misc]
    """A LightningModule over the tiny float64 LM that records what its rank trains on."""

    def __init__(self, p: Dict[str, Any]) -> None:
        super().__init__()
        self.p = p
        self.model = lm_model(p["seed"])
        self.micro: List[Dict[str, Any]] = []
        self.steps: List[Dict[str, Any]] = []
        self._ids: List[int] = []
        self._global_step = 0

    def train_dataloader(self):
        from odb.integrations.lightning import ODBLightningLoader

        p = self.p
        data, sharding = LengthDataset(p["lengths"]), {}
        if p.get("sizes"):  # deliberately uneven: rank r reads its own block of the samples, shuffled per epoch
            start = sum(p["sizes"][:self.global_rank])
            data = torch.utils.data.Subset(data, range(start, start + p["sizes"][self.global_rank]))
            sharding["shuffle"] = True
        else:
            sharding["sampler"] = odb.ShardSampler(data, seed=2)
        budget: Dict[str, Any] = {"token_budget": p["budget"]}
        if p["budget"] == "auto":  # the activation memory of this module's model, every value kept for the test
            from auto_integration_workers import Recording
            from odb.train.memory import ActivationMeter

            self.recording = Recording(ActivationMeter(self.model))
            budget.update(memory_cap_bytes=p["cap"], memory_meter=self.recording, auto_start_budget=p["start"])
        steps_of = {"global_batch_size": p["global_batch"]} if p.get("global_batch") else \
            {"gradient_accumulation_steps": p["accumulation"]}
        if p.get("manual"):  # manual optimisation: the module steps at odb's step ends
            self.automatic_optimization = False
        loader = odb.ODBDataLoader(data, buffer_size=p["buffer"], collate_fn=pad_collate, seed=0, **steps_of,
                                   **budget, **sharding)
        return loader if p.get("raw_loader") else ODBLightningLoader(loader, p.get("snapshot_every", 16))

    def training_step(self, batch, batch_idx):
        from odb.integrations.lightning import scale_loss

        info = getattr(self, "odb_step_info", None)  # ODBCallback sets it (scale_loss says so when it is missing)
        if info is not None:
            ids = [] if info.is_ghost else list(batch["idx"])  # dataset indices; odb's are positions in a Subset
            self.micro.append({"epoch": self.current_epoch, "ids": ids, "info_ids": list(info.sample_ids),
                               "ghost": info.is_ghost, "last": info.is_last_micro_step, "local": info.local_samples,
                               "padding": info.padding_ratio, "padded": info.padded_tokens})
            self._ids += ids
        if not self.automatic_optimization:
            opt = self.optimizers()
            self.manual_backward(scale_loss(self, lm_loss(self.model, batch)))
            if info.is_last_micro_step:
                opt.step()
                opt.zero_grad()
            return None
        return scale_loss(self, lm_loss(self.model, batch))

    def on_train_batch_end(self, outputs, batch, batch_idx):
        stepped = self.trainer.global_step > self._global_step
        self._global_step = self.trainer.global_step
        self.micro[-1]["stepped"] = stepped
        if stepped:
            self.steps.append({"ids": self._ids, "params": [q.detach().clone() for q in self.model.parameters()]})
            self._ids = []
            if self.trainer.global_step == self.p.get("checkpoint_at"):  # as ModelCheckpoint(every_n_train_steps)
                self.trainer.save_checkpoint(self.p["checkpoint"])  # on every rank: the loader state is gathered

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.p["lr"])

    def on_train_end(self):
        p = self.p
        metrics = {k: float(v) for k, v in self.trainer.callback_metrics.items() if k.startswith("odb/")}
        recording = getattr(self, "recording", None)
        stats = self.trainer.train_dataloader.odb_stats
        torch.save({"micro": self.micro, "steps": self.steps, "metrics": metrics,
                    "global_step": self.trainer.global_step, "peaks": recording.values if recording else [],
                    "auto": {k: v for k, v in stats.items() if k.startswith("auto_")}},
                   f"{p['out']}/rank{self.global_rank}.pt")


def lightning_fit(p: Dict[str, Any]) -> None:
    """Trainer.fit with ddp_spawn on CPU (gloo) over p["world"] processes, ODBCallback attached."""
    from odb.integrations.lightning import ODBCallback

    trainer = pl.Trainer(accelerator="cpu", devices=p["world"], strategy="ddp_spawn", max_epochs=p["epochs"],
                         max_steps=p.get("max_steps", -1), accumulate_grad_batches=p["accumulation"],
                         callbacks=[ODBCallback(budget_filled_steps=not p.get("global_batch"))], logger=False,
                         enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(LitLM(p), ckpt_path=p.get("resume_from"))
