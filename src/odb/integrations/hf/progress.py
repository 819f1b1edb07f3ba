"""Training progress counted in samples, for the HF Trainer integration (no transformers import).

The Trainer counts progress in optimizer steps. With the user's batch (``global_batch_size``,
the default) odb keeps them, counted exactly, and the Trainer's schedule runs as it is. With
budget-filled steps (``global_batch_size=None``) odb does not fix them in advance: a step holds
as many samples as the token budget allows. ``SampleProgress`` counts the samples of all ranks
(``ODBStepInfo.all_samples_this_step``, the same number on every rank): ``state.epoch`` always,
and for budget-filled steps the learning-rate schedule (``schedule_by_samples``) and stopping.
``WindowMetrics`` sums what odb adds to the Trainer's logs between two log lines.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional

from odb.step_info import ODBStepInfo


class SampleProgress:
    """Epochs done, in samples: ``completed_epochs + seen_in_epoch / epoch_size``.

    ``epoch_size`` starts as the dataset length and becomes the number of samples the
    last full epoch emitted (fewer when drop_last or oversize="skip" dropped some).

    Example:
        >>> p = SampleProgress(target_epochs=2.0, epoch_size=10)
        >>> p.begin_epoch(0); p.add(4); p.epochs_done, p.fraction()
        (0.4, 0.2)
        >>> p.add(6); p.end_epoch(); p.begin_epoch(1); p.add(10); p.reached()
        True
    """

    def __init__(self, target_epochs: Optional[float], epoch_size: int) -> None:
        self.target_epochs = target_epochs  # None: the run is bounded by max_steps instead
        self.epoch_size = max(int(epoch_size), 1)
        self.epoch = 0
        self.completed_epochs = 0
        self.seen_in_epoch = 0
        self.steps_in_epoch = 0
        self.in_epoch = False  # between begin_epoch and end_epoch

    def begin_epoch(self, epoch: int) -> None:
        self.epoch, self.completed_epochs, self.seen_in_epoch, self.steps_in_epoch = epoch, epoch, 0, 0
        self.in_epoch = True

    def add(self, samples: int) -> None:
        """One optimizer step with ``samples`` samples over all ranks."""
        self.seen_in_epoch += int(samples)
        self.steps_in_epoch += 1

    def end_epoch(self) -> None:
        """The loader ran out: the epoch is complete, whatever its sample count."""
        if self.seen_in_epoch > 0:
            self.epoch_size = self.seen_in_epoch
        self.completed_epochs = self.epoch + 1
        self.seen_in_epoch = 0
        self.steps_in_epoch = 0
        self.in_epoch = False

    @property
    def epochs_done(self) -> float:
        return self.completed_epochs + min(self.seen_in_epoch / self.epoch_size, 1.0)

    def fraction(self) -> float:
        """Share of the run done, in [0, 1] (None target: 0)."""
        if not self.target_epochs:
            return 0.0
        return min(self.epochs_done / self.target_epochs, 1.0)

    def reached(self) -> bool:
        return bool(self.target_epochs) and self.epochs_done >= self.target_epochs - 1e-9

    def steps_left_estimate(self) -> int:
        """Optimizer steps still to run, from this epoch's samples per step so far (at least 1)."""
        if not self.target_epochs or self.steps_in_epoch == 0 or self.seen_in_epoch == 0:
            return 1
        per_step = self.seen_in_epoch / self.steps_in_epoch
        left = (self.target_epochs - self.epochs_done) * self.epoch_size
        return max(1, int(-(-left // per_step)))

    def next_epoch(self) -> int:
        """The epoch to run next: the one in progress, else the one after the last completed."""
        return self.epoch if self.in_epoch else self.completed_epochs

    _FIELDS = ("epoch", "completed_epochs", "seen_in_epoch", "steps_in_epoch", "epoch_size")

    def state_dict(self) -> Dict[str, Any]:
        state: Dict[str, Any] = {k: getattr(self, k) for k in self._FIELDS}
        state["in_epoch"] = self.in_epoch
        return state

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        for key in self._FIELDS:
            setattr(self, key, int(state[key]))
        self.in_epoch = bool(state["in_epoch"])


def schedule_by_samples(lr_lambda: Callable[[float], float], num_training_steps: int,
                        progress: SampleProgress) -> Callable[[int], float]:
    """A LambdaLR factor that reads the schedule at the share of samples seen, not at the step count.

    ``lr_lambda`` is the Trainer's factor over ``num_training_steps`` steps (warmup and
    decay included); the returned function evaluates it at
    ``num_training_steps * progress.fraction()``, so the schedule ends when the data does.

    Example:
        >>> p = SampleProgress(target_epochs=1.0, epoch_size=100)
        >>> f = schedule_by_samples(lambda step: 1 - step / 10, 10, p)
        >>> p.add(50); f(1)
        0.5
    """

    def by_samples(step: int) -> float:  # a plain function: LambdaLR.state_dict() then skips it
        return lr_lambda(num_training_steps * progress.fraction())

    return by_samples


class WindowMetrics:
    """Sums of the micro-batches since the last training log line (this rank)."""

    KEYS = ("real_tokens", "padded_tokens", "samples", "batches", "ghosts")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        self.sums = dict.fromkeys(self.KEYS, 0)
        self.started = self._clock()

    def add(self, infos: Iterable[ODBStepInfo]) -> None:
        for info in infos:
            s = self.sums
            s["ghosts"] += int(info.is_ghost)
            if not info.is_ghost:
                s["real_tokens"] += info.real_tokens
                s["padded_tokens"] += info.padded_tokens
                s["samples"] += info.local_samples
                s["batches"] += 1

    def values(self) -> List[int]:
        return [self.sums[k] for k in self.KEYS]

    def logs(self, totals: List[float]) -> Dict[str, float]:
        """Log entries from the window's sums over all ranks (``totals`` in KEYS order); resets."""
        real, padded, samples, batches, ghosts = totals
        elapsed = max(self._clock() - self.started, 1e-9)
        self.reset()
        return {"odb_padding_ratio": 1.0 - real / padded if padded else 0.0,
                "odb_real_tokens_per_second": real / elapsed, "odb_samples_per_second": samples / elapsed,
                "odb_mean_batch_size": samples / batches if batches else 0.0, "odb_ghost_steps": int(ghosts)}
