"""The two ways an epoch's batches reach the training loop, chosen by whether lengths are known.

- ``OnlineEpoch``: a background thread reads samples through the inner loader, plans and
  collates (odb.epoch.pipeline); the training thread takes ready batches.
- ``KnownLengthsEpoch``: the plan becomes the inner loader's batch sampler; its workers
  collate whole batches, and loss scales are fixed per optimizer step (one exchange per
  step across ranks: odb.epoch.known).

Both hand batches out with the loader's checks, record where the epoch stands (the cursor of
the loader core's ``under_way``, odb.loader.epoch_state) and tell the core when the epoch ends
or stops.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Iterator, Optional

from odb.comm.protocol import RankExchange
from odb.epoch.cursor import Cursor
from odb.epoch.pipeline import BatchPipeline
from odb.epoch.run import EpochRun
from odb.step_info import attach_step_info

if TYPE_CHECKING:
    from odb.loader.core import LoaderCore


# How far up the training loop is from a check made in a mode's generator: the check, the generator, and
# the generator the loader's __iter__ returns (it holds the loader), which the loop calls.
LOOP = 4


class OnlineEpoch:
    """An epoch planned online: the pipeline's thread reads, plans and collates."""

    def __init__(self, core: "LoaderCore", run: EpochRun, pipeline: BatchPipeline) -> None:
        self.core, self.run, self.pipeline = core, run, pipeline

    def wait_s(self) -> float:
        """Seconds the training loop waited in next() this epoch."""
        return self.pipeline.wait_s

    def loss_tokens(self, counted: int) -> int:
        """Supervised tokens handed out this epoch (the planner's count, ``counted``)."""
        return counted

    def batches(self) -> Iterator[Any]:
        """The epoch's batches, each with its step info complete (``loader_wait_s`` included)."""
        core, run, pipeline = self.core, self.run, self.pipeline
        key, check, budget = core.cfg.step_info_key, core.checks, core.budget
        check.reset()
        try:
            for batch, cursor in pipeline:
                core.under_way.cursor = cursor
                info = batch[key] if isinstance(batch, Mapping) else getattr(batch, key)
                info = dataclasses.replace(info, loader_wait_s=pipeline.last_wait_s)
                batch = attach_step_info(batch, info, key)
                check.handed_out(batch, info, stacklevel=LOOP)
                budget.handed_out(info.micro_batch, info.is_ghost)  # (token_budget="auto" measures the step from here)
                yield batch
                budget.request()  # the loop asks for the next batch: the last one's step is over
            check.finished(stacklevel=LOOP)
        except Exception as err:  # raised while odb had the training thread: the other ranks hear this error
            pipeline.abort(err)  # (the batch thread's own errors were told already; a worker's death comes here
            raise  # from torch's SIGCHLD handler when the thread waits for a batch)
        finally:
            if core.under_way.pipeline is pipeline:
                core.stop()  # a `break` or an error: let go of the workers now
        core.epoch_over(run)  # the producer has finished: its counters are final


class KnownLengthsEpoch:
    """An epoch over known lengths: the inner loader's workers collate the planned batches; ``steps``
    exchanges each optimizer step's supervised tokens across ranks (None on one rank)."""

    def __init__(self, core: "LoaderCore", run: EpochRun, pipeline: BatchPipeline,
                 steps: Optional[RankExchange]) -> None:
        self.core, self.run, self.pipeline, self.steps = core, run, pipeline, steps
        self.waited_s = 0.0
        self.loss = 0

    def wait_s(self) -> float:
        """Seconds the training loop waited on the inner loader this epoch."""
        return self.waited_s

    def loss_tokens(self, counted: int) -> int:
        """Supervised tokens handed out this epoch (counted in the collated batches)."""
        return self.loss

    def consumed(self, cursor: Cursor, waited_s: float, loss_tokens: int) -> None:
        """Told of every batch handed to the training loop (odb.epoch.known.known_epoch)."""
        self.core.under_way.cursor = cursor
        self.waited_s += waited_s
        self.loss += loss_tokens

    def batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` (from odb.epoch.known.known_epoch) handed out, with the checks and the epoch's end."""
        core, run, pipeline = self.core, self.run, self.pipeline
        key, check = core.cfg.step_info_key, core.checks
        check.reset()
        try:
            for batch in batches:
                info = batch[key] if isinstance(batch, Mapping) else getattr(batch, key)
                check.handed_out(batch, info, stacklevel=LOOP)
                yield batch
            check.finished(stacklevel=LOOP)
        finally:
            close = getattr(batches, "close", None)
            if close is not None:  # as `yield from` did: a loop that stopped early ends the steps' generator first
                close()
            if core.under_way.pipeline is pipeline:
                core.stop()
        core.epoch_over(run)
