"""PyTorch Lightning: ``Trainer.fit`` on odb batches, DDP included, without Join.

Three pieces, each one line in user code:

- ``ODBLightningLoader(loader)`` (``odb.integrations.lightning_loader``): what ``train_dataloader()``
  returns. It is not a torch DataLoader, so Lightning neither injects its DistributedSampler into it nor rebuilds
  it (whatever ``use_distributed_sampler``), and it has no ``len()``, so Lightning runs
  each epoch until odb's last batch (odb's length is an estimate that Lightning would
  otherwise cut the epoch at). It takes the ``ODBStepInfo`` off every batch before
  Lightning moves the batch to the device.
- ``ODBCallback()``: in ``Trainer(callbacks=[...])``. It checks the setup (one odb
  loader, sharded across ranks, planning the Trainer's optimizer step), makes Lightning's
  automatic optimisation step where odb's optimizer steps end (``odb.integrations.lightning_steps``),
  sets odb's epoch, puts the current batch's step info on ``pl_module.odb_step_info``
  before ``training_step`` and logs ``odb/*`` metrics through ``pl_module.log``.
- ``scale_loss(self, loss)``: in ``training_step``, the exact loss scaling.

The loader keeps your batch: ``ODBDataLoader(batch_size=B, gradient_accumulation_steps=A)`` under
``Trainer(accumulate_grad_batches=A)`` makes every optimizer step hold the B x A x world samples a plain
``DataLoader(batch_size=B)`` gives it, cut into as many micro-batches as fit the token budget; the global
step, ``interval="step"`` schedulers, gradient clipping, logging and checkpoints count optimizer steps.
Budget-filled steps (a loader without ``batch_size``) only with ``ODBCallback(budget_filled_steps=True)``.

Ghost steps (a rank with no data left while others still train) arrive as ordinary
batches with ``loss_scale == 0``: ``training_step`` runs forward and backward on them as
usual (never return None for them), so DDP's collectives stay aligned without Join.

Example::

    import lightning as L
    import odb
    from odb.integrations.lightning import ODBCallback, ODBLightningLoader, scale_loss

    class LitLM(L.LightningModule):
        def train_dataloader(self):                   # here torch.distributed is initialised
            return ODBLightningLoader(odb.ODBDataLoader(
                self.dataset, token_budget=16384, batch_size=8,
                gradient_accumulation_steps=self.trainer.accumulate_grad_batches,
                sampler=odb.ShardSampler(self.dataset), collate_fn=collate_fn))

        def training_step(self, batch, batch_idx):
            return scale_loss(self, self.model(**batch).loss)

    L.Trainer(strategy="ddp", accumulate_grad_batches=2, callbacks=[ODBCallback()]).fit(LitLM())
"""

from __future__ import annotations

import collections
import time
import warnings
import weakref
from typing import Any, Dict, List, Optional

import torch

try:  # the unified package first; the standalone pytorch_lightning package otherwise
    import lightning.pytorch as pl
except ImportError:  # pragma: no cover - depends on what is installed
    import pytorch_lightning as pl

from odb.loader.dataloader import ODBLoaderMixin
from odb.train.loss import scale_loss as exact_scale
from odb.step_info import ODBStepInfo, StepInfoNotPoppedWarning
from odb.integrations.checks import check_sharding
from odb.integrations.lightning_loader import ODBLightningLoader
from odb.integrations.lightning_steps import StepControl

# The step info of the last loss each LightningModule scaled through scale_loss (held weakly: the module's own).
_SCALED: "weakref.WeakKeyDictionary[Any, ODBStepInfo]" = weakref.WeakKeyDictionary()

__all__ = ["ODBCallback", "ODBLightningLoader", "scale_loss"]


def scale_loss(pl_module: Any, loss: torch.Tensor) -> torch.Tensor:
    """The loss ``training_step`` returns: ``loss * odb_step_info.loss_scale * accumulate_grad_batches``.

    ``loss`` is the mean over this batch's supervised tokens. Lightning's automatic
    optimisation divides the returned loss by ``trainer.accumulate_grad_batches`` (which
    ``ODBCallback`` sets per batch when odb plans the steps); odb's ``loss_scale`` already
    spreads the optimizer step's token mean over its micro-batches, so the factor cancels
    that division (it is 1 under manual optimisation). A ghost batch, or one without
    supervised tokens (whose mean loss is 0 / 0 = NaN), gets an exact zero that still runs
    backward (``odb.scale_loss``), so the logged loss stays finite.

    Example::

        def training_step(self, batch, batch_idx):
            return scale_loss(self, self.model(**batch).loss)
    """
    info = getattr(pl_module, "odb_step_info", None)
    if not isinstance(info, ODBStepInfo):
        raise RuntimeError(f"scale_loss found no ODBStepInfo on {type(pl_module).__name__}.odb_step_info: "
                           f"ODBCallback puts it there before each training_step. Fix: "
                           f"Trainer(callbacks=[ODBCallback()]) and return an ODBLightningLoader from "
                           f"train_dataloader().")
    factor = pl_module.trainer.accumulate_grad_batches if pl_module.automatic_optimization else 1
    _SCALED[pl_module] = info  # ODBCallback checks, after the step, that this batch's loss was scaled
    return exact_scale(loss, info, factor)


class ODBCallback(pl.Callback):
    """Connects an ``ODBLightningLoader`` to the Trainer; logs odb's metrics.

    With a loader that keeps your batch (``batch_size=B``, or ``global_batch_size``) Lightning's
    automatic optimisation steps where each of odb's optimizer steps ends, however many
    micro-batches it has (``odb.integrations.lightning_steps.StepControl``: it sets
    ``trainer.accumulate_grad_batches`` before each batch and gives the Trainer its own value back
    when training ends); under manual optimisation your module steps at
    ``self.odb_step_info.is_last_micro_step``, and a step anywhere else is refused.
    ``budget_filled_steps=True`` asks for budget-filled steps (a loader without ``batch_size``:
    ``gradient_accumulation_steps`` micro-batches filled to the budget, other updates than your
    batch gives); without it such a loader is refused, with the fix.

    Every step, through ``pl_module.log`` (this rank's values, no collective unless
    ``sync_dist=True``): ``odb/padding_ratio``, ``odb/batch_size`` (samples in this rank's
    batch), ``odb/real_tokens_per_s`` (this rank), ``odb/samples_per_s`` (all ranks),
    ``odb/loader_wait_s`` (time in ``next(loader)``) and ``odb/rank_imbalance`` (max / mean
    step cost over ranks). At each epoch's end, over all ranks (one small all-reduce per
    value): the means ``odb/padding_ratio_epoch``, ``odb/batch_size_epoch`` (mean batch
    size), ``odb/samples_per_s_epoch``, ``odb/loader_wait_s_epoch``,
    ``odb/rank_imbalance_epoch``, and the sums ``odb/real_tokens_per_s_epoch`` and
    ``odb/ghost_steps`` (ghost steps of all ranks). Rates use the wall time between
    consecutive training batches. After each training batch it checks that ``training_step``
    called ``scale_loss`` for it, and warns once (``StepInfoNotPoppedWarning``, with the fix)
    when it did not: the loss then trained unscaled.

    With a loader of packed rows (``layout="packed"``) it readies the transformers models inside the
    LightningModule at the start of training, as the HF/TRL integrations do: an ``sdpa``/``eager``
    model (exact on packed rows only through a dense mask of the whole row) is switched to
    ``odb_varlen`` and the switch logged once (``odb.packed.models.prepare_packed_model``);
    ``packed_attention="model"`` keeps the model's attention.

    Example::

        trainer = L.Trainer(accumulate_grad_batches=2, callbacks=[ODBCallback()])
    """

    _EPOCH_SUMS = ("odb/real_tokens_per_s_epoch", "odb/ghost_steps")

    def __init__(self, log_metrics: bool = True, sync_dist: bool = False, packed_attention: str = "odb_varlen",
                 budget_filled_steps: bool = False) -> None:
        self.steps = StepControl(budget_filled_steps)  # where Lightning steps the optimizer (lightning_steps)
        self.log_metrics = log_metrics
        self.sync_dist = sync_dist
        self.packed_attention = packed_attention
        self.loader: Optional[ODBLightningLoader] = None
        self.step_info: Optional[ODBStepInfo] = None
        self._warned_unscaled = False
        self._last_end: Optional[float] = None
        self._epoch: Dict[str, float] = collections.defaultdict(float)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._connect(trainer, pl_module)
        if self.loader.loader.odb_config.layout == "packed":  # as the HF/TRL integrations do with the Trainer's model
            from odb.packed.models import prepare_packed_model

            for model in _transformers_models(pl_module):
                prepare_packed_model(model, attention=self.packed_attention)

    def _connect(self, trainer: Any, pl_module: Any) -> None:
        """Find the train loader and check it against the Trainer (at the start, and for a reloaded one)."""
        self.loader = _find_loader(trainer.train_dataloader)
        self.steps.setup(trainer, pl_module, self.loader.loader)
        check_sharding(self.loader.loader, trainer.world_size,
                       "build the loader inside train_dataloader() (torch.distributed is up there) with "
                       "sampler=odb.ShardSampler(dataset), or give the sampler num_replicas=trainer.world_size "
                       "and rank=trainer.global_rank.")

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        if self.loader is not None and _find_loader(trainer.train_dataloader) is not self.loader:
            self._connect(trainer, pl_module)  # reload_dataloaders_every_n_epochs: a new loader this epoch
        if self.loader is not None:
            self.loader.set_epoch(trainer.current_epoch)  # Lightning only tells the samplers
        self._last_end = time.perf_counter()
        self._epoch.clear()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self.loader is None:
            raise RuntimeError("ODBCallback saw a training batch before on_train_start. Fix: use it with "
                               "Trainer.fit.")
        self.step_info = self.loader.next_step_info()
        pl_module.odb_step_info = self.step_info
        self.steps.before_batch(trainer, pl_module, self.step_info, batch_idx)
        if self.loader.auto is not None:  # token_budget="auto": this batch's measurement starts
            self.loader.auto.begin(self.step_info.step, self.step_info.is_ghost)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.loader is not None and self.loader.auto is not None:  # its forward, backward and step are done
            self.loader.auto.end()
        info, now = self.step_info, time.perf_counter()
        if info is not None:
            self.steps.after_batch(trainer, info)
        if info is not None and not self._warned_unscaled \
                and _SCALED.get(pl_module) is not info:
            self._warned_unscaled = True
            _warn_unscaled(info, type(pl_module).__name__)
        elapsed = now - self._last_end if self._last_end is not None else 0.0
        self._last_end = now
        if not self.log_metrics or info is None:
            return
        values = {"odb/padding_ratio": info.padding_ratio, "odb/batch_size": float(info.local_samples),
                  "odb/loader_wait_s": info.loader_wait_s, "odb/rank_imbalance": info.rank_imbalance}
        if elapsed > 0:
            values["odb/real_tokens_per_s"] = info.real_tokens / elapsed
            values["odb/samples_per_s"] = info.all_samples_this_step / elapsed
        for name, value in values.items():
            pl_module.log(name, value, on_step=True, on_epoch=False, batch_size=1, sync_dist=self.sync_dist)
        totals = self._epoch
        for name in ("odb/padding_ratio", "odb/batch_size", "odb/loader_wait_s", "odb/rank_imbalance"):
            totals[name] += values[name]
        totals["steps"] += 1
        totals["ghosts"] += info.is_ghost
        totals["real_tokens"] += info.real_tokens
        totals["all_samples"] += info.all_samples_this_step
        totals["seconds"] += elapsed

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.steps.restore(trainer)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.steps.restore(trainer)

    def state_dict(self) -> Dict[str, Any]:
        return self.steps.state_dict()

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.steps.load_state_dict(state_dict)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self.steps.restore(trainer)  # between epochs (a reloaded train_dataloader reads it) the Trainer's own value
        totals = self._epoch
        if not self.log_metrics or not totals["steps"]:
            return
        steps, seconds = totals["steps"], totals["seconds"]
        values = {f"{name}_epoch": totals[name] / steps
                  for name in ("odb/padding_ratio", "odb/batch_size", "odb/loader_wait_s", "odb/rank_imbalance")}
        values["odb/ghost_steps"] = totals["ghosts"]
        values["odb/real_tokens_per_s_epoch"] = totals["real_tokens"] / seconds if seconds > 0 else 0.0
        values["odb/samples_per_s_epoch"] = totals["all_samples"] / seconds if seconds > 0 else 0.0
        for name, value in values.items():  # every rank logs the same names: the all-reduces line up
            pl_module.log(name, float(value), on_step=False, on_epoch=True, batch_size=1, sync_dist=True,
                          reduce_fx="sum" if name in self._EPOCH_SUMS else "mean")


def _warn_unscaled(info: ODBStepInfo, module: str) -> None:
    # The loss a training_step returns unscaled trains on, silently: the token mean of the step is off.
    warnings.warn(f"odb: {module}.training_step trained a batch (epoch {info.epoch}, step {info.step}) without "
                  f"calling odb.integrations.lightning.scale_loss, so its loss was not scaled by odb's loss_scale "
                  f"and the step's token mean is off. Fix: return the scaled loss from training_step:\n"
                  f"    return scale_loss(self, self.model(**batch).loss)\n"
                  f"(manual optimisation: self.manual_backward(scale_loss(self, loss))). odb warns once per "
                  f"ODBCallback.", StepInfoNotPoppedWarning, stacklevel=2)


def _transformers_models(module: Any) -> List[Any]:
    """The outermost transformers models inside a LightningModule (those with ``set_attn_implementation``)."""
    found: List[Any] = []
    for sub in module.modules():
        if hasattr(sub, "set_attn_implementation") and hasattr(sub, "config") \
                and not any(sub is inner for outer in found for inner in outer.modules()):
            found.append(sub)
    return found


def _find_loader(train_dataloader: Any) -> ODBLightningLoader:
    found = [dl for dl in _flatten(train_dataloader) if isinstance(dl, (ODBLightningLoader, ODBLoaderMixin))]
    if len(found) != 1 or not isinstance(found[0], ODBLightningLoader):
        what = (f"{len(found)} odb loaders" if len(found) > 1 else
                "an odb loader without ODBLightningLoader" if found else
                f"{type(train_dataloader).__name__}, no odb loader")
        raise ValueError(f"ODBCallback needs the Trainer's train dataloader to be one ODBLightningLoader; it found "
                         f"{what}. Fix: return ODBLightningLoader(odb_loader) from train_dataloader() (or pass "
                         f"it as train_dataloaders=).")
    return found[0]


def _flatten(obj: Any) -> List[Any]:
    if isinstance(obj, (list, tuple)):
        return [x for item in obj for x in _flatten(item)]
    if isinstance(obj, dict):
        return [x for item in obj.values() for x in _flatten(item)]
    return [obj]
