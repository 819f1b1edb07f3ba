"""The two parts of a loader's epoch state that its core (odb.loader.core.LoaderCore) keeps.

- ``EpochUnderWay``: the epoch under way (or the last one), as ``EpochAssembly.build`` made it (its
  run, pipeline and mode), where the training loop stands in it (the cursor its mode records at
  each batch) and whether its batch thread has ended (``pipeline_done``).
- ``EpochCounts``: which epoch the next iteration starts (a loaded state it resumes, else the next
  number) and how many steps an epoch has (the last finished epoch's, else ``len()``'s estimate).

Example:
    >>> counts = EpochCounts()
    >>> counts.start_next(), counts.next_epoch
    ((0, None), 1)
    >>> counts.steps(lambda: 7), counts.estimate
    (7, 7)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Optional, Tuple, Union

from odb.epoch.cursor import Cursor
from odb.epoch.pipeline import BatchPipeline
from odb.epoch.run import EpochRun
from odb.loader.assembly import Epoch
from odb.loader.epoch_modes import KnownLengthsEpoch, OnlineEpoch


@dataclasses.dataclass
class EpochUnderWay:
    """The epoch under way, or the last one (all None before the first). Its mode sets ``cursor`` at each
    batch it hands out; ``pipeline_done``: the last pipeline's batch thread has ended (its exchanges can be
    released once every rank has started the next epoch)."""

    run: Optional[EpochRun] = None
    cursor: Optional[Cursor] = None  # where the training loop stands (odb_stats, state_dict)
    pipeline: Optional[BatchPipeline] = None
    mode: Union[OnlineEpoch, KnownLengthsEpoch, None] = None
    pipeline_done: bool = True

    def started(self, built: Epoch) -> None:
        """An epoch ``EpochAssembly.build`` made starts."""
        self.run, self.cursor, self.pipeline, self.mode = built.run, built.cursor, built.pipeline, built.mode

    def finished(self, run: EpochRun) -> None:
        """``run`` ran to its end: the cursor holds its final counters."""
        self.cursor = Cursor(run.snapshot, 0, dataclasses.replace(run.stats))

    def forget_position(self) -> None:
        """A loaded state replaces where the loader stands (the last mode and pipeline stay, stopped)."""
        self.run = None
        self.cursor = None


@dataclasses.dataclass
class EpochCounts:
    """The epoch the next iteration starts and an epoch's step count (see the module's docstring)."""

    next_epoch: int = 0
    resume: Optional[Dict[str, Any]] = None  # a loaded state the next iteration resumes
    last_steps: Optional[int] = None  # steps of the last epoch that ran to its end
    last_steps_epoch: Optional[int] = None  # ... and its number
    estimate: Optional[int] = None  # len()'s estimate (None: not made, or the budget changed)

    def start_next(self) -> Tuple[int, Optional[Dict[str, Any]]]:
        """The epoch an iteration starts now and the state it resumes (None: from its start)."""
        state, self.resume = self.resume, None
        epoch = state["epoch"] if state is not None else self.next_epoch
        self.next_epoch = epoch + 1
        return epoch, state

    def finished(self, run: EpochRun) -> None:
        """``run`` ran to its end: its step count is the loader's len() from now on."""
        self.last_steps = run.step
        self.last_steps_epoch = run.epoch

    def steps(self, estimate: Callable[[], int]) -> int:
        """``len()``: the last finished epoch's steps, else the estimate (made by ``estimate()`` once)."""
        if self.last_steps is not None:
            return self.last_steps
        if self.estimate is None:
            self.estimate = estimate()
        return self.estimate
