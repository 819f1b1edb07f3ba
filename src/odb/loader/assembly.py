"""How a loader builds each epoch: its exchange, its run, its pipeline, in its mode.

``EpochAssembly.build`` takes what an epoch starts from (its number, the saved state of a resumed
one, the seed) and returns the parts the loader keeps (``Epoch``): the ``EpochRun`` (odb.epoch.run)
over the epoch's source (odb.loader.sources), the ``BatchPipeline`` that runs it on the batch thread,
the mode that hands its batches to the training loop (odb.loader.epoch_modes: online, or the inner
loader's workers collating planned batches over known lengths) and that iterator. Everything each
part needs is passed when it is made.

Example:
    >>> import torch, odb
    >>> loader = odb.ODBDataLoader([{"input_ids": torch.ones(3)}] * 4, token_budget=8, collate_fn=list)
    >>> [len(batch) for batch in loader]   # odb.loader.core.LoaderCore.iterate asks EpochAssembly.build
    [2, 2]
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, NamedTuple, Optional, Set, Tuple, Union

import torch
from torch.utils.data import DataLoader

from odb.comm.protocol import ExchangeFactory, RankExchange
from odb.data.sampling import stride_sharded
from odb.epoch.cursor import Cursor
from odb.epoch.known import announce_to_steps, known_epoch
from odb.epoch.local_table import local_tables
from odb.epoch.pipeline import BatchPipeline, made
from odb.epoch.drop_last import DropLast
from odb.epoch.run import EpochRun
from odb.loader.epoch_modes import KnownLengthsEpoch, OnlineEpoch
from odb.loader.inner import InnerLoaders
from odb.loader.sources import EpochSources
from odb.resume.loader_state import resume_order, retained_samples


class Epoch(NamedTuple):
    """The parts of one epoch the loader keeps."""

    run: EpochRun
    cursor: Cursor  # where the epoch stands before its first batch (taken before the batch thread starts)
    pipeline: BatchPipeline
    mode: Union[OnlineEpoch, KnownLengthsEpoch]
    batches: Iterator[Any]


class EpochAssembly:
    """Builds the epochs of one loader (``loader``: its public attributes) from its sources, inner loaders,
    budget (odb.epoch.budget), the collate of a planned group, the per-sample transform and the exchange
    factory (None: a local loader); ``notices`` are the warnings its epochs give once."""

    def __init__(self, loader: DataLoader, *, sources: EpochSources, inner: InnerLoaders, budget: Any,
                 group_collate: Callable[[Any], Any], transform: Optional[Callable[[Any], Any]],
                 exchanges: Optional[ExchangeFactory], shuffle: bool, notices: Set[str],
                 drops: DropLast) -> None:
        self.loader, self.sources, self.inner, self.budget = loader, sources, inner, budget
        self.group_collate, self.transform, self.exchanges = group_collate, transform, exchanges
        self.shuffle, self.notices = shuffle, notices
        self.drops = drops  # the loader's drop_last and the user's batch it keeps whole
        self.exchange: Optional[RankExchange] = None  # the current epoch's (released when the next starts)
        self.warned_shard = False

    def world(self) -> Tuple[int, int]:
        """(rank, world size) without creating anything (no collective)."""
        return self.exchanges.world() if self.exchanges is not None else (0, 1)

    def build(self, owner: Any, *, epoch: int, seed: int, state: Optional[Dict[str, Any]],
              previous: Any, settled: bool) -> Epoch:
        """Epoch ``epoch`` (``state``: the saved state it resumes, or None), for ``owner`` (the LoaderCore its
        mode reports to). ``previous``: the last epoch's mode; ``settled``: the last epoch's batch thread has
        ended, so its exchanges can be released once every rank has started this one."""
        loader, cfg = self.loader, self.budget.options
        run_state = state["run"] if state is not None else None
        exchange, settled = self._new_exchange(settled)
        known = self.sources.known_lengths()
        rank, world_size = self.world()
        order = resume_order(loader.sampler, run_state, epoch, rank, world_size)
        source, marks = self.sources.for_epoch(epoch, run_state, order, fresh=state is None)
        self.budget.epoch_starts(source.peek, resumed=run_state is not None)
        pin = loader.pin_memory and torch.cuda.is_available() and known is None  # known: the inner loader pins
        world = exchange.processes if exchange is not None else 1
        run = EpochRun(cfg, source, list if known is not None else self.group_collate, epoch=epoch,
                       seed=seed, shuffle=self.shuffle, drop_last=self.drops.enabled, batch_unit=self.drops.unit,
                       exchange=exchange, finalize=pin_batch if pin else None,
                       total=self.sources.epoch_total() if order is None else len(order), notices=self.notices,
                       budget=self.budget.epoch(), stream_marks=marks,
                       # The training thread collates what the batch thread has not reached. Not under DDP: there
                       # a batch is collated before the ranks confirm its step, so a failing collate stops every
                       # rank at the same step.
                       lazy=cfg.ready_batches > 0 and world == 1,
                       move_samples=known is None,  # known lengths: a sample is its dataset index
                       tables=self._tables(known, exchange, order, epoch))
        if run_state is not None:
            run.restore(run_state, retained_samples(source, run_state, dataset=loader.dataset,
                                                    sampler=loader.sampler, iterable=self.sources.iterable,
                                                    transform=self.transform, cfg=cfg, known=known, order=order))
        else:
            run.take_snapshot()
        cursor = Cursor(run.snapshot, 0, dataclasses.replace(run.stats))  # before the batch thread moves it
        watch = source.watch  # a worker that died is the cause to announce, not the stop or error it led to

        def announce(error: Optional[BaseException]) -> None:  # a failure or stop reaches every rank
            run.aligner.announce(watch.failure(error) or error)

        pipeline = BatchPipeline(
            iter(run), depth=max(cfg.ready_batches, 0), announce=announce, make=made if run.lazy else None,
            # Known lengths: the inner loader forks its workers below; a thread inside torch (the exchange)
            # while they fork can leave a lock held in them forever, so the batch thread starts at the inner
            # loader's first request for a batch, once its workers exist.
            start=known is None)
        if known is None:
            online = OnlineEpoch(owner, run, pipeline)
            if exchange is not None:
                watch.on_death(stop_at_death(run, pipeline))
            return Epoch(run, cursor, pipeline, online, online.batches())
        declared = self.sources.declared
        inner = self.inner.known(self.group_collate, cfg, declared)
        sampler = inner.batch_sampler
        sampler.next_epoch(pipeline)
        if isinstance(previous, KnownLengthsEpoch) and previous.steps is not None and settled:
            previous.steps.release()  # an epoch left early: every rank has started this one
        steps = self.exchanges(cfg.exchange_timeout_s) if exchange is not None else None
        mode = KnownLengthsEpoch(owner, run, pipeline, steps)
        resume_totals = run_state["position"]["step_tokens"] if run_state is not None else None  # a step split by it
        # workers start here (a persistent inner loader's, the first time)
        batches = declared.unwrap(watch.start(inner))
        if exchange is not None:
            watch.on_death(stop_at_death(run, pipeline, steps))
        return Epoch(run, cursor, pipeline, mode,
                     mode.batches(known_epoch(batches, sampler, cfg, steps, mode.consumed, resume_totals, watch)))

    def _tables(self, known: Any, exchange: Optional[RankExchange], order: Any, epoch: int) -> Any:
        """Known lengths with a stride-sharded sampler and ``global_batch_size`` planned across ranks: every step's
        table computed on every rank (odb.epoch.local_table), none exchanged; None otherwise (or for an epoch
        re-partitioned by an elastic resume, whose order is its own, or whose steps a composition other than the
        sampler's order makes: each rank composes its own)."""
        cfg = self.budget.options
        if known is None or exchange is None or order is not None or cfg.step_plan != "global" or \
                cfg.composition != "sampler" or not stride_sharded(self.loader.sampler):
            return None  # (another sampler is not iterated here: one drawing from torch's RNG would draw again)
        return local_tables(self.loader.sampler, epoch=epoch, rank=exchange.rank, world=exchange.world_size,
                            lengths=known, step_samples=cfg.step_samples(exchange.world_size),
                            own_order=list(self.loader.sampler))

    def _new_exchange(self, settled: bool) -> Tuple[Optional[RankExchange], bool]:
        """This epoch's metadata exchange (a collective call: on the main thread, when iteration starts) and
        whether the last epoch's exchanges are to be released (``settled``; agreed by every rank where the
        transport asks for it: a group over some of the ranks is named by the groups alive in the process, so
        the ranks must release alike to name the next one alike)."""
        if self.exchanges is None or self.exchanges.processes() <= 1:
            return None, settled
        previous = self.exchange
        ex = self.exchange = self.exchanges(self.budget.options.exchange_timeout_s)
        if previous is not None and getattr(ex.transport, "agrees_releases", False):
            settled = ex.all_agree(settled, "the start of an epoch (whether the last one's groups are free)")
        if previous is not None and settled:
            previous.release()  # every rank has started this epoch: the last one's exchanges are over
        sampler = self.loader.sampler
        if not self.warned_shard and not self.sources.iterable and not is_sharded(sampler) and ex.world_size > 1:
            self.warned_shard = True
            warnings.warn(
                f"odb rank {ex.rank}: torch.distributed has {ex.world_size} "
                f"ranks but the loader's sampler ({type(sampler).__name__}) does not shard the dataset, "
                f"so every rank iterates all of it. Fix: pass sampler=odb.ShardSampler(dataset) or a "
                f"DistributedSampler.", stacklevel=5)
        return ex, settled


def stop_at_death(run: EpochRun, pipeline: BatchPipeline, steps: Optional[RankExchange] = None
                  ) -> Callable[[RuntimeError], None]:
    """What an epoch under several ranks does the moment one of its workers dies (odb.data.worker_deaths):
    whatever the training thread does meanwhile (torch raises the death there, maybe in the user's step,
    and the user may keep the iterator or exit), the batch thread stops and announces the death to every
    rank at its next exchange, and (known lengths) so does the step exchange of the training thread."""

    def stop(death: RuntimeError) -> None:
        pipeline.abort(death)
        run.close()  # a batch thread waiting for the dead worker's samples goes on at once
        if steps is not None:
            announce_to_steps(steps, run.cfg, death)

    return stop


def is_sharded(sampler: Any) -> bool:
    """Whether a sampler shards the dataset over several replicas (DistributedSampler, odb.ShardSampler)."""
    return hasattr(sampler, "num_replicas") and getattr(sampler, "num_replicas", 1) > 1


def pin_batch(obj: Any) -> Any:
    """``obj`` with its tensors in pinned memory (mappings, named tuples, lists and tuples keep their types)."""
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    if isinstance(obj, Mapping):
        if type(obj) is dict:
            return {k: pin_batch(v) for k, v in obj.items()}
        for k in list(obj.keys()):  # dict-like batch types (e.g. BatchEncoding) keep their type
            obj[k] = pin_batch(obj[k])
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(pin_batch(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(pin_batch(v) for v in obj)
    return obj

