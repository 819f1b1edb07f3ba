"""Where Lightning steps the optimizer when odb plans the optimizer steps (the user's batch kept).

``ODBDataLoader(batch_size=B, gradient_accumulation_steps=A)`` keeps a plain ``DataLoader(batch_size=B)``'s
optimizer step under ``Trainer(accumulate_grad_batches=A)``: B x A x world samples, cut into as many
micro-batches as fit the token budget, so a step has a varying number of micro-batches. Lightning's automatic
optimisation steps after every ``accumulate_grad_batches``-th batch of an epoch and after its last, zeroing
the gradients before the first of each window. ``StepControl`` sets that public Trainer attribute before each
batch (as Lightning's ``GradientAccumulationScheduler`` callback does before each epoch) so that Lightning
accumulates until odb's step ends and steps there; everything Lightning counts in optimizer steps follows:
``trainer.global_step``, ``interval="step"`` LR schedulers, gradient clipping, DDP's gradient sync (only on
a step's last micro-batch), the logging step and ``ModelCheckpoint(every_n_train_steps=...)``. The
gradients are zeroed before each step's first micro-batch through the module's ``optimizer_zero_grad``
hook. After each batch it checks that Lightning stepped exactly where odb's step ends (a Lightning that
counts batches otherwise is refused there, never trained silently wrong), and under manual optimisation
that the module did. The Trainer's own value is restored at each epoch's end (a train_dataloader() that
Lightning reloads reads it) and when training ends.

Budget-filled steps (a loader without ``batch_size``: ``gradient_accumulation_steps`` micro-batches filled
to the budget, other updates than the user's batch) run only when asked for by name,
``ODBCallback(budget_filled_steps=True)``; Lightning then steps every ``accumulate_grad_batches`` batches
as usual, and the loader must plan that many.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any, Dict, Optional

from odb.integrations.checks import check_accumulation
from odb.loader.dataloader import ODBLoaderMixin
from odb.step_info import ODBStepInfo

__all__ = ["StepControl"]

_NEVER = sys.maxsize  # an accumulate_grad_batches no batch count of an epoch reaches: Lightning accumulates


class StepControl:
    """Makes Lightning step where odb's optimizer steps end (see the module docstring); one per ``ODBCallback``.

    Example:
        >>> control = StepControl(budget_filled_steps=False)
        >>> control.state_dict()
        {'step_ended': True}
    """

    def __init__(self, budget_filled_steps: bool) -> None:
        self.budget_filled_steps = bool(budget_filled_steps)
        self.steers = False  # automatic optimisation over odb's steps: accumulate_grad_batches set per batch
        self.manual = False
        self.user_accumulation: Optional[int] = None  # the Trainer's value, restored after each epoch and at the end
        self.steps_before = 0
        self.step_ended = True  # whether the last trained batch ended an optimizer step (saved in checkpoints)
        self.resumed_step_ended: Optional[bool] = None
        self.warned_no_step = False

    # ---- setup ---------------------------------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, loader: ODBLoaderMixin) -> None:
        """Check the loader's optimizer steps against the Trainer's settings (refusing a mismatch with the
        fix) and decide how the steps are driven."""
        cfg = loader.odb_config
        g, accumulation, world = cfg.global_batch_size, int(trainer.accumulate_grad_batches), int(trainer.world_size)
        self.manual = not pl_module.automatic_optimization
        if g is None:
            if not self.budget_filled_steps:
                raise ValueError(_budget_filled_message(cfg, accumulation, world, self.manual))
            if not self.manual:  # Lightning steps every accumulate_grad_batches batches: odb plans the same
                check_accumulation(loader, accumulation, "the Trainer")
            return
        if self.budget_filled_steps:
            raise ValueError(f"ODBCallback(budget_filled_steps=True) got an odb loader that keeps global_batch_size="
                             f"{g} samples per optimizer step. Rule: budget-filled steps are a loader without "
                             f"batch_size and global_batch_size. Fix: drop budget_filled_steps=True (odb keeps the "
                             f"loader's steps), or build the loader without batch_size and global_batch_size.")
        if self.manual:
            return  # the module steps at odb_step_info.is_last_micro_step; after_batch checks that it does
        unit = loader.odb_core.drops.unit  # the batch_size the loader was given (None: global_batch_size alone)
        if unit is not None and g != unit * accumulation * world:
            raise ValueError(_accumulation_message(g, unit, accumulation, world))
        from lightning.pytorch.callbacks import GradientAccumulationScheduler

        if any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):
            raise ValueError(f"ODBCallback got a GradientAccumulationScheduler, which changes accumulate_grad_batches "
                             f"from epoch to epoch, while the odb loader keeps global_batch_size={g} samples in every "
                             f"optimizer step. Rule: one optimizer step, set on the loader. Fix: drop the scheduler "
                             f"and keep Trainer(accumulate_grad_batches={accumulation}).")
        self.steers, self.user_accumulation = True, accumulation
        if self.resumed_step_ended is not None:
            # A resumed epoch: Lightning counts the checkpoint's batch as an optimizer step (its logging step) when
            # the Trainer's value divides the epoch's batches so far; make that say whether odb's step had ended.
            trainer.accumulate_grad_batches = 1 if self.resumed_step_ended else _NEVER
            self.resumed_step_ended = None

    # ---- every training batch ---------------------------------------------------------------------------
    def before_batch(self, trainer: Any, pl_module: Any, info: ODBStepInfo, batch_idx: int) -> None:
        """Set where Lightning steps for this batch (automatic) and zero the gradients before a step's first."""
        self.steps_before, self.step_ended = int(trainer.global_step), info.is_last_micro_step
        if not self.steers:
            return
        seen = batch_idx + 1  # batches of this epoch so far, this one included: Lightning steps when A divides it
        # (and zeroes before one whose index A divides: with these values only an epoch's first batch)
        trainer.accumulate_grad_batches = seen if info.is_last_micro_step else seen + 1
        if info.micro_step == 0 and batch_idx > 0:
            optimizer = trainer.optimizers[0]
            pl_module.optimizer_zero_grad(trainer.current_epoch, batch_idx, optimizer)

    def after_batch(self, trainer: Any, info: ODBStepInfo) -> None:
        """Refuse a step where odb's step goes on (and, automatic, a missing one), naming the fix."""
        stepped = int(trainer.global_step) > self.steps_before
        if stepped == info.is_last_micro_step:
            return
        where = (f"micro-batch {info.micro_step + 1} of {info.micro_steps} of odb's optimizer step {info.step} "
                 f"(epoch {info.epoch})")
        if self.manual:
            if stepped:
                raise RuntimeError(
                    f"the LightningModule stepped the optimizer after {where}: that step's gradient holds only part "
                    f"of its samples (loss_scale normalises over all of them). Rule: under manual optimisation step "
                    f"once per odb step. Fix: call opt.step() and opt.zero_grad() only when "
                    f"self.odb_step_info.is_last_micro_step (keep Trainer(accumulate_grad_batches=1), which Lightning "
                    f"requires under manual optimisation; the loader's batch_size and gradient_accumulation_steps "
                    f"set the samples of a step).")
            if not self.warned_no_step:
                self.warned_no_step = True
                warnings.warn(f"odb: the LightningModule did not step the optimizer after {where}, its last: the next "
                              f"step's gradient adds this one's, each normalised over its own step. Fix: call "
                              f"opt.step() and opt.zero_grad() when self.odb_step_info.is_last_micro_step. odb warns "
                              f"once.", RuntimeWarning, stacklevel=2)
            return
        from lightning import __version__ as version

        what = "stepped the optimizer after" if stepped else "did not step the optimizer after"
        raise RuntimeError(
            f"Lightning {version} {what} {where}, where odb's step {'goes on' if stepped else 'ends'}. Rule: odb sets "
            f"trainer.accumulate_grad_batches before each batch so that automatic optimisation steps at odb's step "
            f"ends (Lightning 2.5-2.6 step when it divides the epoch's batch count), and this Lightning steps "
            f"elsewhere. Fix: install lightning>=2.5,<2.7, or use manual optimisation (self.automatic_optimization = "
            f"False, Trainer(accumulate_grad_batches=1), step when self.odb_step_info.is_last_micro_step).")

    def restore(self, trainer: Any) -> None:
        """Give the Trainer back its own accumulate_grad_batches (an epoch or training ended, or it raised)."""
        if self.user_accumulation is not None:
            trainer.accumulate_grad_batches = self.user_accumulation

    # ---- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {"step_ended": self.step_ended}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.resumed_step_ended = bool(state.get("step_ended", True))


def _budget_filled_message(cfg: Any, accumulation: int, world: int, manual: bool) -> str:
    k = cfg.gradient_accumulation_steps
    keep = (f"odb.ODBDataLoader(..., batch_size=B, gradient_accumulation_steps=k) in train_dataloader() with "
            f"Trainer(accumulate_grad_batches=1) (Lightning's own accumulation is off under manual optimisation), "
            f"stepping when self.odb_step_info.is_last_micro_step: each optimizer step then holds B x k x {world} "
            f"samples" if manual else
            f"odb.ODBDataLoader(..., batch_size=B, gradient_accumulation_steps=self.trainer.accumulate_grad_batches) "
            f"in train_dataloader(): each optimizer step then holds B x {accumulation} x {world} samples, as "
            f"DataLoader(batch_size=B) with accumulate_grad_batches={accumulation} gives")
    return (f"ODBCallback got an odb loader built without batch_size (global_batch_size=None): each optimizer step "
            f"would be {k} micro-batch(es) filled to token_budget={cfg.token_budget}, as many samples as fit, so "
            f"training would take fewer, larger steps than your batch gives. Rule: budget-filled steps only when "
            f"asked for by name. Fix: keep your batch: {keep}, cut into micro-batches under the budget; or ask for "
            f"budget-filled steps: ODBCallback(budget_filled_steps=True).")


def _accumulation_message(g: int, unit: int, accumulation: int, world: int) -> str:
    planned = g // (unit * world) if g % (unit * world) == 0 else None
    other = f", or Trainer(accumulate_grad_batches={planned})" if planned else ""
    return (f"the odb loader keeps global_batch_size={g} samples per optimizer step, but its batch_size={unit} x "
            f"accumulate_grad_batches={accumulation} x {world} process(es) = {unit * accumulation * world}: a "
            f"DataLoader(batch_size={unit}) under this Trainer would step on {unit * accumulation * world} samples. "
            f"Rule: the loader plans the Trainer's step. Fix: build the loader with gradient_accumulation_steps="
            f"self.trainer.accumulate_grad_batches (= {accumulation}) in train_dataloader(){other}.")
