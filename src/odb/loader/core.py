"""LoaderCore: everything an odb loader does, held in one object the DataLoader delegates to.

``ODBDataLoader`` and loaders converted by ``odb.apply`` keep one attribute, the core. It
reads the DataLoader's public attributes (dataset, sampler, num_workers, ...), owns the
inner loaders (odb.loader.inner), the exchanges between ranks (made by an exchange
factory: odb.comm.dist.GroupExchanges, or odb.comm.threads for ranks that are threads),
the current epoch, the counters and the resume state (odb.resume.loader_state).

An epoch runs in one of two modes, chosen by whether the loader knows every sample's
length up front (``lengths=``):

- ``OnlineEpoch``: a background thread reads samples through the inner loader, plans and
  collates; the training thread takes ready batches.
- ``KnownLengthsEpoch``: the plan becomes the inner loader's batch sampler; its workers
  collate whole batches, and loss scales are fixed per optimizer step (one exchange per
  step across ranks).

Example:
    >>> import torch, odb
    >>> loader = odb.ODBDataLoader([{"input_ids": torch.ones(3)}] * 4, token_budget=8, collate_fn=list)
    >>> core = loader.odb_core
    >>> core.world(), core.cfg.token_budget
    ((0, 1), 8)
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from odb.arguments import check_in_order
from odb.comm.dist import GroupExchanges
from odb.comm.protocol import ExchangeFactory, RankExchange
from odb.config import ODBConfig
from odb.data.bucket_collate import PadToBucket
from odb.data.collate_check import PaddingHint
from odb.data.lengths import LabelBudgetCheck, check_length_dims
from odb.data.sampling import EpochShuffleSampler, ShardSampler
from odb.data.source import SampleMeter, SampleSource, WorkerWatch, stream_records, unpack_records
from odb.data.stream_state import StreamMarks
from odb.epoch.known import known_epoch, known_records
from odb.epoch.pipeline import BatchPipeline
from odb.epoch.auto import AutoControl
from odb.loader.budgets import make_budget
from odb.epoch.run import EpochRun, made
from odb.epoch.stats import EpochStats
from odb.loader.batch_checks import BatchChecks
from odb.loader.inner import InnerLoaders
from odb.loader.length_probe import check_probed_fit, probe_lengths
from odb.plan.estimate import DEFAULT_PROBE, estimate_steps, probe_size
from odb.resume.loader_state import (PlanOptions, loader_fields, resume_order, retained_samples, saved_state,
                                     state_to_resume)
from odb.epoch.cursor import Cursor
from odb.loader.epoch_modes import KnownLengthsEpoch, OnlineEpoch


def exchange_factory(cfg: ODBConfig, process_group: Any = None, exchange: Optional[ExchangeFactory] = None
                     ) -> Optional[ExchangeFactory]:
    """Where a loader's exchanges come from: ``exchange`` (a factory: ``world()`` and
    ``factory(timeout_s) -> RankExchange``), else torch.distributed (``process_group`` or the
    default group); None for a local loader (``distributed=False``)."""
    if process_group is not None and exchange is not None:
        raise ValueError(f"odb got process_group={process_group!r} and exchange={exchange!r}: both say how the "
                         f"ranks exchange. Rule: one of them. Fix: drop one (exchange= is for tests and custom "
                         f"transports, e.g. odb.comm.threads.ThreadRanks(n).exchanges(rank)).")
    for name, given in (("process_group", process_group), ("exchange", exchange)):
        if given is not None and not cfg.distributed:
            raise ValueError(f"odb got {name}={given!r} with distributed=False: a local loader "
                             f"exchanges nothing. Fix: drop {name}, or drop distributed=False.")
    if not cfg.distributed:
        return None
    return exchange if exchange is not None else GroupExchanges(process_group)


class LoaderCore:
    """The odb side of one loader (see the module's docstring).

    ``loader`` is the DataLoader it serves (read through its public attributes);
    ``group_collate`` collates a planned group of samples, ``sample_transform`` (or None)
    runs per sample in the workers; ``own_sampler`` is the loader's own seeded shuffle
    sampler (``shuffle=True`` without a sampler), else None; ``exchanges`` from
    ``exchange_factory``.
    """

    def __init__(self, loader: DataLoader, cfg: ODBConfig, *, shuffle: bool, seed: int,
                 group_collate: Callable[[Any], Any], sample_transform: Optional[Callable[[Any], Any]],
                 own_sampler: Optional[EpochShuffleSampler], lengths: Optional[Sequence[int]] = None,
                 exchanges: Optional[ExchangeFactory] = None) -> None:
        check_in_order(getattr(loader, "in_order", True))
        check_length_dims(cfg.token_budgets, cfg.length_fn, lengths)
        self.loader = loader
        # The window budget (odb.epoch.budget): fixed, scheduled or token_budget="auto"; it holds the options
        self.budget = make_budget(cfg, lengths)
        self.shuffle, self.seed = shuffle, seed
        if cfg.shape_buckets is not None and not isinstance(group_collate, PadToBucket):
            # odb plans each batch at a bucket length; the collate pads to the longest sample: pad on to the bucket
            group_collate = PadToBucket(group_collate, cfg.shape_buckets, ignore_index=cfg.ignore_index)
        self.group_collate = PaddingHint(group_collate)  # a collate that cannot pad names the fix
        self.label_check = LabelBudgetCheck(cfg.length_fn, cfg.label_key)
        self.transform = sample_transform
        self.own_sampler = own_sampler
        self.lengths = None if lengths is None else np.asarray(lengths)
        self.exchanges = exchanges
        self.inner = InnerLoaders(loader, sample_transform)
        self.next_epoch = 0
        self.last_steps: Optional[int] = None  # steps of the last epoch that ran to its end
        self.last_steps_epoch: Optional[int] = None
        self.estimate: Optional[int] = None
        self.run: Optional[EpochRun] = None
        self.cursor: Optional[Cursor] = None
        self.pipeline: Optional[BatchPipeline] = None
        self.pipeline_done = True
        self.mode: Union[OnlineEpoch, KnownLengthsEpoch, None] = None  # the current (or last) epoch's
        self.resume: Optional[Dict[str, Any]] = None
        self.exchange: Optional[RankExchange] = None  # the current epoch's (released when the next starts)
        self.oom: Optional[Any] = None
        self.warned_shard = False
        self.notices: set = set()  # warnings the loader's epochs give once (odb.epoch.run.EpochRun.notices)
        self.checks = BatchChecks(cfg)  # warns once: a forgotten pop_step_info, labels that need shift_labels
        self.plan_options = PlanOptions()
        # The next epoch's source, started by len() to read its first window (odb.data.source.SampleSource.peek):
        # (epoch, the sampler's epoch, source, stream marks).
        self.prepared: Optional[Tuple[int, Any, SampleSource, Optional[StreamMarks]]] = None
        self.known_lengths()  # refuses lengths that do not match the dataset, now
        cfg.step_samples(self.world()[1])  # refuses a global_batch_size that the ranks cannot share, now

    @property
    def cfg(self) -> ODBConfig:
        """The user's options (``odb_config``; ``set_token_budget`` changes them)."""
        return self.budget.options

    @property
    def auto(self) -> Optional[AutoControl]:
        """token_budget="auto"'s control (for integrations that measure steps themselves), else None."""
        return self.budget if isinstance(self.budget, AutoControl) else None

    # ---- what the loader's public methods do ---------------------------------------------------
    def stats(self) -> Dict[str, Any]:
        """``odb_stats``: this epoch's counters up to the last batch handed out, plus OOM counters."""
        cursor = self.cursor
        stats = dataclasses.replace(cursor.stats) if cursor is not None else EpochStats()
        stats.wait_s = self.wait_s(stats.wait_s)
        if self.mode is not None:
            stats.loss_tokens = self.mode.loss_tokens(stats.loss_tokens)
        if self.run is not None:
            stats.read_ahead_max = self.run.source.peak_samples
            stats.read_ahead_tokens_max = self.run.source.peak_tokens
        out = stats.as_dict()
        if self.oom is not None:
            out.update({k if k.startswith("oom") else f"oom_{k}": v for k, v in self.oom.as_dict().items()})
        out.update(self.budget.stats(self.run.budget if self.run is not None else None))
        return out

    def oom_counters(self) -> Any:
        """``odb_oom_counters``: made on first use."""
        if self.oom is None:
            from odb.train.oom import OOMCounters

            self.oom = OOMCounters()
            self.oom.on_oom = self.budget.on_oom  # odb.train.oom tells of an out-of-memory batch: auto learns it
        return self.oom

    def wait_s(self, default: float = 0.0) -> float:
        """Seconds the training loop waited in next() this epoch (``default`` before any epoch)."""
        return self.mode.wait_s() if self.mode is not None else default

    def abort(self, reason: "BaseException | str") -> None:
        """``odb_abort``: stop this epoch and tell the other ranks."""
        error = reason if isinstance(reason, BaseException) else RuntimeError(str(reason))
        if self.pipeline is not None:
            self.pipeline.abort(error)
        self.stop()

    def set_token_budget(self, token_budget: Any) -> None:
        """``set_token_budget``: from the next planning window on."""
        self.budget.set_token_budget(token_budget)  # the next windows plan under it (token_budget="auto" refuses)
        self.estimate = None

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch``: odb's epoch, and the sampler's (unless it is odb's own)."""
        self.next_epoch = int(epoch)
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch") and sampler is not self.own_sampler:
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        if self.last_steps is not None:
            return self.last_steps
        if self.estimate is None:
            self.estimate = self._estimate_steps()
        return self.estimate

    def iterate(self) -> Iterator[Any]:
        """``iter(loader)``: start the next epoch (or the resumed one) in its mode."""
        self.stop()
        loader, cfg = self.loader, self.cfg
        state, self.resume = self.resume, None
        epoch = state["epoch"] if state is not None else self.next_epoch
        self.next_epoch = epoch + 1
        if self.own_sampler is not None:
            self.own_sampler.set_epoch(epoch)
        run_state = state["run"] if state is not None else None
        exchange = self._new_exchange()
        known = self.known_lengths()
        # A resumed epoch: the consumed prefix of its order is skipped; a re-partitioned one has its own order.
        skip = run_state["position"]["arrived"] if run_state and not self.iterable else 0
        rank, world_size = self.world()
        order = resume_order(loader.sampler, run_state, epoch, rank, world_size)
        marks = None
        if known is not None:
            records = known_records(iter(loader.sampler) if order is None else order, known, skip)
            source = SampleSource(records, cap_samples=cfg.buffer_size, cap_tokens=cfg.window_tokens,
                                  threaded=cfg.ready_batches > 0)
        else:
            prepared = self._take_prepared(epoch if state is None else None)  # len() read its first window
            source, marks = prepared if prepared is not None else self._source(
                skip=skip, order=order, stream=run_state["position"]["stream"] if run_state is not None else None)
        self.budget.epoch_starts(source.peek, resumed=run_state is not None)
        pin = loader.pin_memory and torch.cuda.is_available() and known is None  # known: the inner loader pins
        window_budget = self.budget.epoch()  # (a resumed epoch's restores its part with the run's state)
        world = exchange.world_size if exchange is not None else 1
        run = EpochRun(cfg, source, list if known is not None else self.group_collate, epoch=epoch,
                       seed=self.seed, shuffle=self.shuffle, drop_last=bool(loader.drop_last),
                       exchange=exchange, finalize=pin_batch if pin else None,
                       total=self._epoch_total() if order is None else len(order), notices=self.notices,
                       budget=window_budget, stream_marks=marks,
                       # The training thread collates what the batch thread has not reached. Not under DDP: there
                       # a batch is collated before the ranks confirm its step, so a failing collate stops every
                       # rank at the same step.
                       lazy=cfg.ready_batches > 0 and world == 1)
        if run_state is not None:
            run.restore(run_state, retained_samples(source, run_state, dataset=loader.dataset,
                                                    sampler=loader.sampler, iterable=self.iterable,
                                                    transform=self.transform, cfg=cfg, known=known, order=order))
        else:
            run.take_snapshot()
        self.run = run
        self.cursor = Cursor(run.snapshot, 0, dataclasses.replace(run.stats))
        watch = source.watch  # a worker that died is the cause to announce, not the stop or error it led to

        def announce(error: Optional[BaseException]) -> None:  # a failure or stop reaches every rank
            run.aligner.announce(watch.failure(error) or error)

        pipeline = self.pipeline = BatchPipeline(
            iter(run), depth=max(cfg.ready_batches, 0), announce=announce, make=made if run.lazy else None,
            # Known lengths: the inner loader forks its workers below; a thread inside torch (the exchange)
            # while they fork can leave a lock held in them forever, so the batch thread starts at the inner
            # loader's first request for a batch, once its workers exist.
            start=known is None)
        previous = self.mode
        if known is None:
            online = self.mode = OnlineEpoch(self, run, pipeline)
            return online.batches()
        inner = self.inner.known(self.group_collate)
        sampler = inner.batch_sampler
        sampler.plan = pipeline
        sampler.infos.clear()
        if isinstance(previous, KnownLengthsEpoch) and previous.steps is not None and self.pipeline_done:
            previous.steps.release()  # an epoch left early: every rank has started this one
        steps = self.exchanges(cfg.exchange_timeout_s) if exchange is not None else None
        mode = self.mode = KnownLengthsEpoch(self, run, pipeline, steps)
        resume_totals = run_state["position"]["step_tokens"] if run_state is not None else None  # a step split by the resume
        batches = watch.follow(iter(inner))  # workers start here (a persistent inner loader's, the first time)
        return mode.batches(known_epoch(batches, sampler, cfg, steps, mode.consumed, resume_totals, watch))

    def accumulation(self) -> Optional[int]:
        """Micro-batches per optimizer step: fixed, or None where ``global_batch_size`` plans them per step."""
        return None if self.cfg.global_batch_size is not None else self.cfg.gradient_accumulation_steps

    def optimizer_steps(self) -> Optional[int]:
        """Optimizer steps of an epoch with ``global_batch_size``: ceil(samples / global_batch_size), floor
        with ``drop_last`` (None: budget-filled steps, or a sampler without a length)."""
        rank, world_size = self.world()
        g = self.cfg.step_samples(world_size)
        if g is None or self.iterable:
            return None
        sampler = self.loader.sampler
        try:
            n = len(sampler)
            if isinstance(sampler, ShardSampler):  # ranks differ by one sample at most: the largest share counts
                n = -(-len(sampler.data_source) // sampler.num_replicas)
        except TypeError:
            return None
        return n // g if self.loader.drop_last else -(-n // g)

    def state_dict(self) -> Dict[str, Any]:
        """``state_dict``: where the loader is, as plain data (odb.resume.loader_state.saved_state)."""
        rank, world_size = self.world()
        return saved_state(self.run, self.cursor, finished_epoch=self.last_steps_epoch, next_epoch=self.next_epoch,
                           seed=self.seed, wait_s=self.wait_s(), accumulation=self.accumulation(),
                           rank=rank, world_size=world_size, fields=self._fields(),
                           budget=self.budget.loader_state())

    def load_state_dict(self, state: Union[Dict[str, Any], Sequence[Dict[str, Any]]]) -> None:
        """``load_state_dict``: resume from ``state`` at the next iteration."""
        rank, world_size = self.world()
        sampler = self.loader.sampler
        state = state_to_resume(state, rank=rank, world_size=world_size, sampler=sampler,
                                own_sampler=self.own_sampler is not None, fields=self._fields())
        self.seed = int(state["seed"])
        if self.own_sampler is not None:
            self.own_sampler.seed = self.seed
        self.resume = state if state["run"] is not None else None
        self.next_epoch = int(state["epoch"])
        self.budget.load_loader_state(state["budget"], resumed=state["run"] is not None)
        if self.own_sampler is None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(int(state["epoch"]))  # the saved epoch's order (DistributedSampler, ShardSampler)
        self.stop()
        self.run = None
        self.cursor = None
        if self.inner.stream is not None:
            self.inner.forget()  # persistent workers hold a copy of the stream: start fresh ones with its state

    # ---- the parts -------------------------------------------------------------------------------
    @property
    def iterable(self) -> bool:
        """Whether the dataset is an IterableDataset."""
        return isinstance(self.loader.dataset, IterableDataset)

    @property
    def inner_loader(self) -> Optional[DataLoader]:
        """The inner loader kept across epochs (``persistent_workers=True``), else None."""
        return self.inner.persistent

    def world(self) -> Tuple[int, int]:
        """(rank, world size) without creating anything (no collective)."""
        return self.exchanges.world() if self.exchanges is not None else (0, 1)

    def stop(self) -> None:
        """End the previous iteration's background work, if any."""
        self.pipeline_done = True
        pipeline, run = self.pipeline, self.run
        self.budget.close()  # (auto: a batch thread waiting for the training loop's measurements goes on)
        if pipeline is not None:
            late = None
            try:  # a worker that died: torch raised it on the training thread, maybe outside odb; tell the others
                died = run.source.watch.failure() if run is not None and not pipeline.done else None
            except Exception as err:  # torch's signal handler raised the death just now
                died = late = err
            if died is not None:
                pipeline.abort(died)
            pipeline.stop()
            if run is not None:
                run.close()
            self.pipeline_done = pipeline.close()
            if late is not None:
                raise late

    def epoch_over(self, run: EpochRun) -> None:
        """An epoch ran to its end: its counters are final and its step count is the loader's len()."""
        self.cursor = Cursor(run.snapshot, 0, dataclasses.replace(run.stats))
        self.last_steps = run.step
        self.last_steps_epoch = run.epoch

    def known_lengths(self) -> Optional[np.ndarray]:
        """(n, D) lengths when odb plans from known lengths (workers then collate whole batches)."""
        lengths, dataset = self.lengths, self.loader.dataset
        if lengths is None or self.iterable or self.cfg.image_patches_key is not None:
            return None
        lengths = lengths.reshape(len(lengths), -1)
        if len(lengths) != len(dataset):
            raise ValueError(f"odb got lengths= for {len(lengths)} samples but the dataset has "
                             f"{len(dataset)}. Rule: one length (or tuple of lengths) per dataset index, after "
                             f"the dataset's processing. Fix: pass lengths of the processed dataset, in index order.")
        return lengths

    def _fields(self) -> Dict[str, Any]:
        loader = self.loader
        return loader_fields(loader.dataset, loader.sampler, loader.num_workers, self.plan_options(self.cfg),
                             self.iterable)

    def _new_exchange(self) -> Optional[RankExchange]:
        """This epoch's metadata exchange (a collective call: on the main thread, when iteration starts)."""
        if self.exchanges is None or self.world()[1] <= 1:
            return None
        previous = self.exchange
        ex = self.exchange = self.exchanges(self.cfg.exchange_timeout_s)
        if previous is not None and self.pipeline_done:
            previous.release()  # every rank has started this epoch: the last one's exchanges are over
        sampler = self.loader.sampler
        if not self.warned_shard and not self.iterable and not is_sharded(sampler):
            self.warned_shard = True
            warnings.warn(
                f"odb rank {ex.rank}: torch.distributed has {ex.world_size} "
                f"ranks but the loader's sampler ({type(sampler).__name__}) does not shard the dataset, "
                f"so every rank iterates all of it. Fix: pass sampler=odb.ShardSampler(dataset) or a "
                f"DistributedSampler.", stacklevel=4)
        return ex

    def _epoch_total(self) -> Optional[int]:
        """Samples of an epoch on this rank, when the sampler knows (windows ramp down towards the end)."""
        if self.iterable:
            return None
        try:
            return len(self.loader.sampler)
        except TypeError:
            return None

    def _source(self, skip: int = 0, order: Optional[Sequence[int]] = None,
                stream: Optional[Dict[str, Any]] = None) -> Tuple[SampleSource, Optional[StreamMarks]]:
        """The epoch's sample source (from position ``skip`` of ``order``, default the sampler's; an
        iterable stream from its saved restart point) and the stream's restart points, if it has state."""
        cfg, num_workers = self.cfg, self.loader.num_workers
        inner = self.inner.online(cfg)
        if self.inner.chunk_sampler is not None:
            self.inner.chunk_sampler.skip, self.inner.chunk_sampler.order = skip, order
        packed = num_workers > 0
        meter = SampleMeter(cfg)
        watch = WorkerWatch()
        if not self.iterable:
            batches = watch.follow(iter(inner))  # workers start here
            chunks: Iterator[Any] = (unpack_records(c, packed, meter) for c in batches)
            marks = None
        else:
            first, marks, wrapper = (stream["start"] if stream else 0), None, self.inner.stream
            if wrapper is not None:
                wrapper.start = stream["states"] if stream else None
                marks = StreamMarks(first, wrapper.start, num_workers)
            batches = watch.follow(iter(inner))  # workers start here, on this thread, each with its copy of the wrapper
            if wrapper is not None:
                wrapper.start = None
            chunks = stream_records(batches, packed, meter, first, marks.on_chunk if marks is not None else None)
        chunks = self.label_check.wrap(chunks)  # warns when target labels go unbudgeted
        return SampleSource(chunks, cap_samples=cfg.buffer_size, cap_tokens=self.budget.read_ahead_tokens(),
                            threaded=cfg.ready_batches > 0, watch=watch), marks

    def _estimate_steps(self) -> int:
        """Steps per epoch, from known lengths or a probe of the dataset read once (odb.plan.estimate)."""
        cfg, dataset, sampler = self.cfg, self.loader.dataset, self.loader.sampler
        if self.iterable:
            raise TypeError("len() of an odb loader over an IterableDataset is known only after one epoch. "
                            "Fix: iterate one epoch first, or use max_steps in the trainer.")
        n, total = len(sampler), len(dataset)
        world_size = self.world()[1]
        if n == 0 or total == 0:
            return 0
        lengths = self.lengths
        columns = getattr(dataset, "column_names", None)
        if lengths is None and isinstance(columns, list) and "length" in columns:
            lengths = np.asarray(dataset["length"])  # a datasets.Dataset with a length column
        if lengths is None:
            lengths = self._first_window(n)
        if lengths is None:
            lengths = probe_lengths(dataset, self.transform, cfg, self.inner.workers())
        cfg = self.budget.planning_config(self.run.budget if self.run is not None else None, lengths)
        check_probed_fit(lengths, cfg, "len(loader) measured the dataset's samples",
                         total if self.lengths is not None else None)  # known lengths: by index
        return max(1, estimate_steps(np.asarray(lengths), n, cfg, world_size=world_size))

    def _first_window(self, n: int) -> Optional[np.ndarray]:
        """Lengths of the next epoch's first samples, read by that epoch's own source and kept for its
        iteration (no sample is read twice), as many as ``probe_size`` asks for; None where they are no
        uniform sample of the data (the sampler does not shuffle), where ranks would each see their own
        (under DDP len() must agree on every rank: the probe reads the same samples on each), or where an
        epoch is under way or a resume is pending."""
        shuffled = self.own_sampler is not None or shuffles(self.loader)
        if not shuffled or self.world()[1] > 1 or self.resume is not None or \
                (self.pipeline is not None and not self.pipeline.done):
            return None
        epoch = self.next_epoch
        if self.prepared is None or self.prepared[:2] != self._sampler_epoch(epoch):
            self._drop_prepared()
            if self.own_sampler is not None:
                self.own_sampler.set_epoch(epoch)
            source, marks = self._source()
            self.prepared = self._sampler_epoch(epoch) + (source, marks)
            weakref.finalize(self.loader, source.close)  # a loader dropped without iterating lets go of its workers
        source = self.prepared[2]
        want = min(DEFAULT_PROBE, n)
        try:
            while True:
                lengths = np.array([meta[0] for meta in source.peek(want)], dtype=np.int64)
                need = probe_size(lengths, n, self.cfg)
                if need <= len(lengths) or len(lengths) < want or want >= n:
                    return lengths
                want = need
        except BaseException:
            self._drop_prepared()
            raise

    def _sampler_epoch(self, epoch: int) -> Tuple[int, Any]:
        """What fixes the order of the next epoch: odb's epoch and the sampler's own."""
        return epoch, getattr(self.loader.sampler, "epoch", None)

    def _take_prepared(self, epoch: Optional[int]) -> Optional[Tuple[SampleSource, Optional[StreamMarks]]]:
        """The source len() started for this epoch, if it still reads this epoch's order (else closed)."""
        prepared, self.prepared = self.prepared, None
        if prepared is None:
            return None
        if epoch is not None and prepared[:2] == self._sampler_epoch(epoch):
            return prepared[2], prepared[3]
        prepared[2].close()
        return None

    def _drop_prepared(self) -> None:
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            prepared[2].close()


def is_sharded(sampler: Any) -> bool:
    """Whether a sampler shards the dataset over several replicas (DistributedSampler, odb.ShardSampler)."""
    return hasattr(sampler, "num_replicas") and getattr(sampler, "num_replicas", 1) > 1


def shuffles(loader: DataLoader) -> bool:
    """Whether a loader's sampler shuffles (RandomSampler or a sampler with shuffle=True)."""
    sampler = getattr(loader, "sampler", None)
    return isinstance(sampler, RandomSampler) or bool(getattr(sampler, "shuffle", False))


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
