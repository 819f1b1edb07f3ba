"""Lightning runs with a plain DataLoader(batch_size=B) and with odb's loader keeping that batch, for
tests/integrations/test_lightning_batch.py.

Both runs train the tiny float64 LM of dist_workers (``lm_model``) with SGD under automatic optimisation,
``accumulate_grad_batches=A``, a learning rate that decays every optimizer step (a LambdaLR with
``interval="step"``) and gradient clipping. The data is read in order: the plain run's DataLoader (to which
gives a DistributedSampler(shuffle=False) on several processes) and odb's ``ShardSampler(shuffle=False)`` hand
each rank every W-th sample, so an optimizer step holds the same B x A x W samples in both runs; odb cuts
them into micro-batches of its own under the token budget. The plain module normalises its loss by the
supervised tokens of the whole step (counted from the data, all ranks), which is the token mean odb's
``scale_loss`` gives: the two runs' float64 parameters after every optimizer step must then agree.

``fit`` runs on every rank of dist_harness.run_ranks ("lightning_workers:suite"), whose gloo group Lightning's
DDP strategy takes as it finds it (the launcher's variables are set, as torchrun sets them), and in the
test process for one process.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import lightning.pytorch as pl
import torch

import odb
from dist_workers import lm_loss, lm_model
from helpers import IGNORE, LengthDataset, make_sample, pad_collate


def step_tokens(p: Dict[str, Any], world: int) -> List[int]:
    """Supervised tokens of each optimizer step of an epoch: rank r reads samples r, r + W, ..., a step takes
    the next B x A of each rank's."""
    lengths, share = p["lengths"], p["batch"] * p["accumulation"]
    orders = [list(range(r, len(lengths), world)) for r in range(world)]
    steps = -(-max(len(o) for o in orders) // share)
    return [sum(int((make_sample(i, lengths[i])["labels"] != IGNORE).sum())
                for o in orders for i in o[s * share:(s + 1) * share]) for s in range(steps)]


class BatchLM(pl.LightningModule):
    """The LM under a plain DataLoader (``p["odb"]`` false) or odb's loader with the same batch."""

    def __init__(self, p: Dict[str, Any]) -> None:
        super().__init__()
        self.p = p
        # manual optimisation: "last" steps at odb's step ends (as the guide says), "each" after every batch
        self.automatic_optimization = p.get("manual") is None
        self.model = lm_model(p["seed"])
        self.records: List[Dict[str, Any]] = []
        self.micro: List[int] = []  # odb: micro-batches of each optimizer step on this rank
        self._count = 0
        self._last = 0
        self._ids: List[int] = []

    def train_dataloader(self):
        p, data = self.p, LengthDataset(self.p["lengths"])
        if not p["odb"]:  # in order on every rank (Lightning's own DistributedSampler would shuffle here)
            sampler = torch.utils.data.DistributedSampler(data, shuffle=False) if self.trainer.world_size > 1 else None
            return torch.utils.data.DataLoader(data, batch_size=p["batch"], sampler=sampler, collate_fn=pad_collate)
        from odb.integrations.lightning import ODBLightningLoader

        options = dict(batch_size=p["batch"], gradient_accumulation_steps=self.trainer.accumulate_grad_batches)
        options.update(p.get("loader", {}))  # e.g. {"batch_size": None}: what a misconfiguration test changes
        loader = odb.ODBDataLoader(data, token_budget=p["budget"], sampler=odb.ShardSampler(data, shuffle=False),
                                   collate_fn=pad_collate, buffer_size=16, seed=0,
                                   shift_labels=False, **options)  # lm_loss does not shift
        return ODBLightningLoader(loader, snapshot_every=p.get("snapshot_every", 16))

    def training_step(self, batch, batch_idx):
        self.log("batch_size", float(len(batch["idx"])), on_step=True, batch_size=1)  # a metrics line per batch
        self._ids += [int(i) for i in batch["idx"]]
        if self.p["odb"]:
            from odb.integrations.lightning import scale_loss

            self._count += 1
            loss = scale_loss(self, lm_loss(self.model, batch))
            if self.automatic_optimization:
                return loss
            self.manual_backward(loss)
            if self.p["manual"] == "each" or self.odb_step_info.is_last_micro_step:
                self.optimizers().step()
                self.optimizers().zero_grad()
                self.lr_schedulers().step()
            return None
        tokens = step_tokens(self.p, self.trainer.world_size)
        total = tokens[self.trainer.global_step % len(tokens)]
        # Lightning divides by accumulate_grad_batches and DDP averages over the ranks: the step's token mean
        return lm_loss(self.model, batch, reduction="sum") / total * self.trainer.accumulate_grad_batches \
            * self.trainer.world_size

    def on_train_start(self):
        self._last = self.trainer.global_step  # a resumed run starts at the checkpoint's step

    def on_train_batch_end(self, outputs, batch, batch_idx):
        step = self.trainer.global_step
        if step == self._last:
            return
        self._last = step
        self.records.append({"step": step, "lr": self.lr_schedulers().get_last_lr()[0], "ids": sorted(self._ids),
                             "params": [q.detach().clone() for q in self.model.parameters()]})
        self.micro.append(self._count)
        self._count, self._ids = 0, []
        if step == self.p.get("checkpoint_at"):
            self.trainer.save_checkpoint(self.p["checkpoint"])  # on every rank (the loader state is gathered)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.p["lr"])
        decay = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.3 * step))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": decay, "interval": "step"}}


class StepLogger(pl.loggers.Logger):
    """Records the step of every metrics line Lightning logs."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: List[int] = []

    @property
    def name(self) -> str:
        return "steps"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: Dict[str, float], step: int = None) -> None:
        self.steps.append(int(step))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def fit(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """``Trainer.fit`` per ``p`` on this rank: every optimizer step's learning rate and parameters."""
    from odb.integrations.lightning import ODBCallback

    if world > 1:  # what a launcher (torchrun) sets; the harness's gloo group is already up
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    module, logger = BatchLM(p), StepLogger()
    saves = [pl.callbacks.ModelCheckpoint(dirpath=p["checkpoints"], every_n_train_steps=3, save_top_k=-1)] \
        if p.get("checkpoints") else []  # counts optimizer steps, as without odb
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                         max_epochs=p["epochs"], max_steps=p.get("max_steps", -1),
                         reload_dataloaders_every_n_epochs=1 if p.get("reload") else 0,
                         accumulate_grad_batches=p["accumulation"], gradient_clip_val=p["clip"],
                         callbacks=([ODBCallback(**p.get("callback", {}))] + p.get("callbacks", []) if p["odb"] else [])
                         + saves, logger=logger, log_every_n_steps=1,
                         enable_checkpointing=bool(saves), enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0)
    trainer.fit(module, ckpt_path=p.get("resume_from"))
    return {"records": module.records, "micro": module.micro, "global_step": trainer.global_step,
            "logged": logger.steps, "accumulation": trainer.accumulate_grad_batches}


def suite(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Several fits in one set of processes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only contend
    try:
        return [fit(rank, world, run) for run in p["runs"]]
    finally:
        torch.set_num_threads(threads)
