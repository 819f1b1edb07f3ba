"""ODBDataLoader: a torch DataLoader whose batches are planned under a token budget."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
import weakref
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler, default_collate

from odb.arguments import check_in_order, check_options
from odb.loader.batch_checks import BatchChecks
from odb.data.bucket_collate import PadToBucket
from odb.data.collate_check import PaddingHint
from odb.config import CONFIG_FIELDS, ODBConfig
from odb.comm.dist import RankExchange, world
from odb.epoch.run import EpochRun, made
from odb.plan.estimate import DEFAULT_PROBE, estimate_steps, probe_size
from odb.epoch.known import GroupCollate, PlannedBatchSampler, known_epoch, known_records
from odb.loader.length_probe import Workers, check_probed_fit, meter_for_workers, probe_lengths
from odb.data.lengths import LabelBudgetCheck, check_length_dims
from odb.resume.loader_state import ResumableLoader
from odb.packed.collate import PackedCollate
from odb.epoch.pipeline import BatchPipeline
from odb.resume.state import Cursor
from odb.data.sampling import ChunkSampler, EpochShuffleSampler, IndexedDataset, TransformedIterable
from odb.data.source import ChunkCollate, SampleMeter, SampleSource, WorkerWatch, stream_records, unpack_records
from odb.data.stream_state import StatefulStream, StreamMarks, has_own_state
from odb.epoch.stats import EpochStats

# Chunks from the workers grow to this many times transfer_chunk_size (odb.data.sampling.ChunkSampler).
CHUNK_GROWTH = 8
_HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters
# The other arguments of ODBDataLoader (suggested for misspelt options).
_LOADER_ARGS = tuple(inspect.signature(DataLoader.__init__).parameters)[1:] + ("config", "lengths",
                                                                            "process_group")


def make_config(config: Optional[ODBConfig], token_budget: Any, options: Dict[str, Any], who: str = "odb",
                also: Sequence[str] = (), rule: str = "odb options are odb.ODBConfig fields") -> ODBConfig:
    """One ODBConfig from a config object and/or keyword options. ``who`` names the caller in errors; a
    misspelt option gets the closest ODBConfig field (or name in ``also``), a batch size odb's rule."""
    check_options(options, who, CONFIG_FIELDS | set(also), rule)
    if config is not None:
        if token_budget is not None:
            options["token_budget"] = token_budget
        return config.replace(**options) if options else config
    if token_budget is None:
        raise TypeError("odb needs token_budget (the most padded tokens per batch, B x L). "
                        "Fix: pass token_budget=16384 or config=ODBConfig(...).")
    return ODBConfig(token_budget=token_budget, **options)


def check_inputs(cfg: ODBConfig, lengths: Optional[Sequence[int]], in_order: Any) -> None:
    """What ODBDataLoader and odb.apply refuse before they change anything: ``in_order=False``, and
    per-dimension budgets that nothing measures."""
    check_in_order(in_order)
    check_length_dims(cfg.token_budgets, cfg.length_fn, lengths)


def draw_seed(generator: Optional[torch.Generator], sampler: Any = None) -> int:
    """A base seed: from the DataLoader's generator when given, else the sampler's own seed (a
    DistributedSampler's or odb.ShardSampler's: its shuffle and odb's batch order then repeat
    together), else torch's global RNG."""
    if generator is not None:
        return int(generator.initial_seed()) % (2**62)
    own = getattr(sampler, "seed", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own % (2**62)
    return int(torch.empty((), dtype=torch.int64).random_().item()) % (2**62)


class ODBLoaderMixin(ResumableLoader):
    """The odb behaviour shared by ODBDataLoader and loaders converted by odb.apply.

    It subclasses DataLoader (and is never built directly) so that a loader's class can
    be switched in place: Python allows that only between classes of the same layout.
    """
    _odb_cfg: ODBConfig

    def _odb_setup(self, cfg: ODBConfig, *, shuffle: bool, seed: int,
                   group_collate: Callable[[Any], Any], sample_transform: Optional[Callable[[Any], Any]],
                   own_sampler: Optional[EpochShuffleSampler], lengths: Optional[Sequence[int]] = None,
                   process_group: Any = None) -> None:
        check_in_order(getattr(self, "in_order", True))
        check_length_dims(cfg.token_budgets, cfg.length_fn, lengths)
        if process_group is not None and not cfg.distributed:
            raise ValueError(f"odb got process_group={process_group!r} with distributed=False: a local loader "
                             f"exchanges nothing. Fix: drop process_group, or drop distributed=False.")
        self._odb_cfg = cfg
        self._odb_shuffle = shuffle
        self._odb_seed = seed
        if cfg.shape_buckets is not None and not isinstance(group_collate, PadToBucket):
            # odb plans each batch at a bucket length; the collate pads to the longest sample: pad on to the bucket
            group_collate = PadToBucket(group_collate, cfg.shape_buckets, ignore_index=cfg.ignore_index)
        self._odb_group_collate = PaddingHint(group_collate)  # a collate that cannot pad names the fix
        self._odb_label_check = LabelBudgetCheck(cfg.length_fn, cfg.label_key)
        self._odb_transform = sample_transform
        self._odb_own_sampler = own_sampler
        self._odb_lengths = None if lengths is None else np.asarray(lengths)
        self._odb_next_epoch = 0
        self._odb_inner: Optional[DataLoader] = None
        self._odb_last_steps: Optional[int] = None
        self._odb_last_steps_epoch: Optional[int] = None
        self._odb_estimate: Optional[int] = None
        self._odb_run: Optional[EpochRun] = None
        self._odb_cursor: Optional[Cursor] = None
        self._odb_pipeline: Optional[BatchPipeline] = None
        self._odb_resume: Optional[Dict[str, Any]] = None
        self._odb_chunk_sampler: Optional[ChunkSampler] = None
        self._odb_stream: Optional[StatefulStream] = None  # an IterableDataset with its own state, wrapped
        self._odb_group = process_group
        self._odb_exchange: Optional[RankExchange] = None
        self._odb_oom: Optional[Any] = None
        self._odb_warned_shard = False
        self._odb_pipeline_done = True
        self._odb_step_exchange: Any = False  # False: online mode; None or a RankExchange: known lengths
        self._odb_known_wait = 0.0
        self._odb_known_loss = 0
        self._odb_notices: set = set()  # warnings the loader's epochs give once (odb.epoch.run.EpochRun.notices)
        self._odb_checks = BatchChecks(cfg)  # warns once: a forgotten pop_step_info, labels that need shift_labels
        # The next epoch's source, started by len() to read its first window (odb.data.source.SampleSource.peek):
        # (epoch, the sampler's epoch, source, stream marks).
        self._odb_prepared: Optional[Tuple[int, Any, SampleSource, Optional[StreamMarks]]] = None
        self._odb_known_lengths()  # refuses lengths that do not match the dataset, now

    # ---- public ----------------------------------------------------------------------
    @property
    def odb_config(self) -> ODBConfig:
        """The options this loader plans with."""
        return self._odb_cfg

    @property
    def odb_stats(self) -> Dict[str, Any]:
        """Counters of the current (or last) epoch on this rank, up to the last batch the training loop
        received (plus OOM counters, since the loader was built)."""
        cursor = self._odb_cursor
        stats = dataclasses.replace(cursor.stats) if cursor is not None else EpochStats()
        stats.wait_s = self._odb_wait_s(stats.wait_s)
        if self._odb_step_exchange is not False:  # known lengths: the training loop waits on the inner loader
            stats.loss_tokens = self._odb_known_loss
        if self._odb_run is not None:
            stats.read_ahead_max = self._odb_run.source.peak_samples
            stats.read_ahead_tokens_max = self._odb_run.source.peak_tokens
        out = stats.as_dict()
        if self._odb_oom is not None:
            out.update({k if k.startswith("oom") else f"oom_{k}": v for k, v in self._odb_oom.as_dict().items()})
        return out

    @property
    def odb_oom_counters(self) -> Any:
        """Pass as ``odb.train.oom.train_step_with_oom_fallback(..., counters=loader.odb_oom_counters)``: the
        OOM counts then appear in ``odb_stats``."""
        if self._odb_oom is None:
            from odb.train.oom import OOMCounters

            self._odb_oom = OOMCounters()
        return self._odb_oom

    def _odb_wait_s(self, default: float = 0.0) -> float:
        """Seconds the training loop waited in next() this epoch."""
        if self._odb_step_exchange is not False:  # known lengths: the training loop waits on the inner loader
            return self._odb_known_wait
        return self._odb_pipeline.wait_s if self._odb_pipeline is not None else default

    def odb_abort(self, reason: "BaseException | str") -> None:
        """Stop this epoch because of ``reason`` (an exception or a message) found on the training thread,
        and tell the other ranks: they raise ``odb.comm.dist.ODBRankFailed`` naming this rank and the reason at
        their next exchange, instead of waiting for this rank. Then raise your error as usual.

        odb's integrations call it for their own checks; call it yourself when you catch an error of
        the training loop and keep the process alive (a notebook, a handler that saves a checkpoint).

        Example:
            >>> import torch, odb
            >>> loader = odb.ODBDataLoader([{"input_ids": torch.ones(4)}] * 4, token_budget=8, collate_fn=list)
            >>> it = iter(loader); batch = next(it)
            >>> loader.odb_abort(ValueError("bad labels"))   # on one process: just stops the epoch
            >>> next(it)
            Traceback (most recent call last):
            ...
            ValueError: bad labels
        """
        error = reason if isinstance(reason, BaseException) else RuntimeError(str(reason))
        pipeline = self._odb_pipeline
        if pipeline is not None:
            pipeline.abort(error)
        self._odb_stop()

    def set_token_budget(self, token_budget: Any) -> None:
        """Use ``token_budget`` from the next planning window on (replaces any budget_schedule).

        The loader plans up to a window ahead of the training loop, so the new budget reaches
        batches once the windows already planned are used up. Under DDP call it on every rank
        at the same step. To resume after a change, call it again on the fresh loader before
        ``load_state_dict``.
        """
        self._odb_cfg = self._odb_cfg.replace(token_budget=token_budget, budget_schedule=None)
        self._odb_estimate = None
        run = self._odb_run
        if run is not None:
            run.cfg = run.cfg.replace(budget_schedule=None)
            run.set_token_budget(token_budget)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration (and of the sampler, when it has set_epoch)."""
        self._odb_next_epoch = int(epoch)
        sampler = getattr(self, "sampler", None)
        if hasattr(sampler, "set_epoch") and sampler is not self._odb_own_sampler:
            sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        self._odb_stop()
        state, self._odb_resume = self._odb_resume, None
        epoch = state["epoch"] if state is not None else self._odb_next_epoch
        self._odb_next_epoch = epoch + 1
        if self._odb_own_sampler is not None:
            self._odb_own_sampler.set_epoch(epoch)
        run_state = state["run"] if state is not None else None
        exchange = self._odb_new_exchange()
        known = self._odb_known_lengths()
        # A resumed epoch: the consumed prefix of its order is skipped; a re-partitioned one has its own order.
        skip = run_state["arrived"] if run_state and not self._odb_is_iterable() else 0
        order = self._odb_resume_order(run_state, epoch)
        marks = None
        if known is not None:
            records = known_records(iter(self.sampler) if order is None else order, known, skip)
            source = SampleSource(records, cap_samples=self._odb_cfg.buffer_size,
                                  cap_tokens=self._odb_cfg.window_tokens, threaded=self._odb_cfg.ready_batches > 0)
        else:
            prepared = self._odb_take_prepared(epoch if state is None else None)  # len() read its first window
            source, marks = prepared if prepared is not None else self._odb_source(
                skip=skip, order=order, stream=run_state["stream"] if run_state is not None else None)
        pin = self.pin_memory and torch.cuda.is_available() and known is None  # known: the inner loader pins
        run = EpochRun(self._odb_cfg, source, list if known is not None else self._odb_group_collate, epoch=epoch,
                       seed=self._odb_seed, shuffle=self._odb_shuffle, drop_last=bool(self.drop_last),
                       exchange=exchange, finalize=self._odb_pin if pin else None,
                       total=self._odb_epoch_total() if order is None else len(order), notices=self._odb_notices)
        run.stream_marks = marks
        if run_state is not None:
            run.restore(run_state, self._odb_retained(source, run_state, known, order))
        else:
            run.take_snapshot()
        self._odb_run = run
        self._odb_cursor = Cursor(run.snapshot, 0, dataclasses.replace(run.stats))
        # The training thread collates what the batch thread has not reached. Not under DDP: there a batch is
        # collated before the ranks confirm its step, so a failing collate stops every rank at the same step.
        run.lazy = self._odb_cfg.ready_batches > 0 and run.world_size == 1
        watch = source.watch  # a worker that died is the cause to announce, not the stop or error it led to

        def announce(error: Optional[BaseException]) -> None:  # a failure or stop reaches every rank
            run.aligner.announce(watch.failure(error) or error)

        self._odb_pipeline = BatchPipeline(iter(run), depth=max(self._odb_cfg.ready_batches, 0), announce=announce,
                                           make=made if run.lazy else None,
                                           # Known lengths: the inner loader forks its workers below; a thread
                                           # inside torch (the exchange) while they fork can leave a lock held in
                                           # them forever, so the batch thread starts at the inner loader's first
                                           # request for a batch, once its workers exist.
                                           start=known is None)
        if known is None:
            self._odb_step_exchange = False
            return self._odb_epoch(run, self._odb_pipeline)
        inner = self._odb_known_inner()
        sampler = inner.batch_sampler
        sampler.plan = self._odb_pipeline
        sampler.infos.clear()
        if isinstance(self._odb_step_exchange, RankExchange) and self._odb_pipeline_done:
            self._odb_step_exchange.release()  # an epoch left early: every rank has started this one
        steps = RankExchange(self._odb_cfg.exchange_timeout_s, self._odb_group) if exchange is not None else None
        self._odb_step_exchange = steps
        resume_totals = run_state["step_tokens"] if run_state is not None else None  # a step split by the resume
        batches = watch.follow(iter(inner))  # workers start here (a persistent inner loader's, the first time)
        return self._odb_known_epoch(run, self._odb_pipeline, known_epoch(batches, sampler, self._odb_cfg, steps,
                                                                          self._odb_consumed, resume_totals, watch))

    def __len__(self) -> int:
        """Batches per epoch: exact after a full epoch, else an estimate from sample lengths."""
        if self._odb_last_steps is not None:
            return self._odb_last_steps
        if self._odb_estimate is None:
            self._odb_estimate = self._odb_estimate_steps()
        return self._odb_estimate

    # ---- internals -----------------------------------------------------------------------
    def _odb_new_exchange(self) -> Optional[RankExchange]:
        """This epoch's metadata exchange (a collective call: on the main thread, when iteration starts)."""
        if not self._odb_cfg.distributed or (self._odb_group is None and world()[1] <= 1):
            return None
        previous = self._odb_exchange
        self._odb_exchange = RankExchange(self._odb_cfg.exchange_timeout_s, self._odb_group)
        if previous is not None and self._odb_pipeline_done:
            previous.release()  # every rank has started this epoch: the last one's exchanges are over
        ex = self._odb_exchange
        if not self._odb_warned_shard and not self._odb_is_iterable() and not _is_sharded(self.sampler):
            self._odb_warned_shard = True
            warnings.warn(
                f"odb rank {ex.rank}: torch.distributed has {ex.world_size} "
                f"ranks but the loader's sampler ({type(self.sampler).__name__}) does not shard the dataset, "
                f"so every rank iterates all of it. Fix: pass sampler=odb.ShardSampler(dataset) or a "
                f"DistributedSampler.", stacklevel=3)
        return ex

    def _odb_world(self) -> tuple:
        """(rank, world size) without creating anything (no collective)."""
        if not self._odb_cfg.distributed:
            return 0, 1
        if self._odb_group is not None:
            import torch.distributed as dist

            return dist.get_rank(self._odb_group), dist.get_world_size(self._odb_group)
        return world()

    def _odb_stop(self) -> None:
        """End the previous iteration's background work, if any."""
        self._odb_pipeline_done = True
        pipeline, run = self._odb_pipeline, self._odb_run
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
            self._odb_pipeline_done = pipeline.close()
            if late is not None:
                raise late

    def _odb_epoch(self, run: EpochRun, pipeline: BatchPipeline) -> Iterator[Any]:
        key = self._odb_cfg.step_info_key
        check = self._odb_checks
        check.reset()
        try:
            for batch, cursor in pipeline:
                self._odb_cursor = cursor
                info = batch[key] if isinstance(batch, Mapping) else getattr(batch, key)
                object.__setattr__(info, "loader_wait_s", pipeline.last_wait_s)  # not yet seen by anyone
                check.handed_out(batch, info)
                yield batch
            check.finished()
        except Exception as err:  # raised while odb had the training thread: the other ranks hear this error
            pipeline.abort(err)  # (the batch thread's own errors were told already; a worker's death comes here
            raise  # from torch's SIGCHLD handler when the thread waits for a batch)
        finally:
            if self._odb_pipeline is pipeline:
                self._odb_stop()  # a `break` or an error: let go of the workers now
        # The producer has finished: its counters are final (the last window may have planned no batch).
        self._odb_cursor = Cursor(run.snapshot, 0, dataclasses.replace(run.stats))
        self._odb_last_steps = run.step
        self._odb_last_steps_epoch = run.epoch

    def _odb_epoch_total(self) -> Optional[int]:
        """Samples of an epoch on this rank, when the sampler knows (windows ramp down towards the end)."""
        if self._odb_is_iterable():
            return None
        try:
            return len(self.sampler)
        except TypeError:
            return None

    def _odb_consumed(self, cursor: Cursor, waited_s: float, loss_tokens: int) -> None:
        self._odb_cursor = cursor
        self._odb_known_wait += waited_s
        self._odb_known_loss += loss_tokens

    def _odb_known_epoch(self, run: EpochRun, pipeline: BatchPipeline, batches: Iterator[Any]) -> Iterator[Any]:
        self._odb_known_wait = 0.0
        self._odb_known_loss = 0
        key, check = self._odb_cfg.step_info_key, self._odb_checks
        check.reset()
        try:
            for batch in batches:
                check.handed_out(batch, batch[key] if isinstance(batch, Mapping) else getattr(batch, key))
                yield batch
            check.finished()
        finally:
            close = getattr(batches, "close", None)
            if close is not None:  # as `yield from` did: a loop that stopped early ends the steps' generator first
                close()
            if self._odb_pipeline is pipeline:
                self._odb_stop()
        self._odb_cursor = Cursor(run.snapshot, 0, dataclasses.replace(run.stats))
        self._odb_last_steps = run.step
        self._odb_last_steps_epoch = run.epoch

    def _odb_known_lengths(self) -> Optional[np.ndarray]:
        """(n, D) lengths when odb plans from known lengths (workers then collate whole batches)."""
        lengths = self._odb_lengths
        if lengths is None or self._odb_is_iterable() or self._odb_cfg.image_patches_key is not None:
            return None
        lengths = lengths.reshape(len(lengths), -1)
        if len(lengths) != len(self.dataset):
            raise ValueError(f"odb got lengths= for {len(lengths)} samples but the dataset has "
                             f"{len(self.dataset)}. Rule: one length (or tuple of lengths) per dataset index, after "
                             f"the dataset's processing. Fix: pass lengths of the processed dataset, in index order.")
        return lengths

    def _odb_known_inner(self) -> DataLoader:
        if self._odb_inner is not None:
            return self._odb_inner
        kwargs: Dict[str, Any] = dict(
            num_workers=self.num_workers, pin_memory=self.pin_memory, timeout=self.timeout,
            worker_init_fn=self.worker_init_fn, multiprocessing_context=self.multiprocessing_context,
            generator=self.generator, persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            pin_memory_device=getattr(self, "pin_memory_device", ""))
        if _HAS_IN_ORDER:
            kwargs["in_order"] = getattr(self, "in_order", True)
        inner = DataLoader(self.dataset, batch_sampler=PlannedBatchSampler(),
                           collate_fn=GroupCollate(self._odb_group_collate, self._odb_transform), **kwargs)
        if self.persistent_workers:
            self._odb_inner = inner
        return inner

    def _odb_is_iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    def _odb_inner_loader(self) -> DataLoader:
        if self._odb_inner is not None:
            return self._odb_inner
        cfg = self._odb_cfg
        iterable = self._odb_is_iterable()
        self._odb_worker_meter = meter_for_workers(SampleMeter(cfg), self._odb_workers())
        collate = ChunkCollate(self._odb_worker_meter, indexed=not iterable, pack=self.num_workers > 0)
        kwargs: Dict[str, Any] = dict(
            num_workers=self.num_workers, collate_fn=collate, pin_memory=False, timeout=self.timeout,
            worker_init_fn=self.worker_init_fn, multiprocessing_context=self.multiprocessing_context,
            generator=self.generator, persistent_workers=self.persistent_workers,
            prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None)
        if _HAS_IN_ORDER:
            kwargs["in_order"] = getattr(self, "in_order", True)
        if iterable:
            ds = self.dataset if self._odb_transform is None else TransformedIterable(self.dataset, self._odb_transform)
            if has_own_state(self.dataset):  # resumable through its own state: tag chunks with it
                ds = self._odb_stream = StatefulStream(self.dataset, self._odb_transform, cfg.transfer_chunk_size)
                kwargs["collate_fn"] = ChunkCollate(self._odb_worker_meter, indexed=False, pack=self.num_workers > 0,
                                                    tagged=True)
            inner = DataLoader(ds, batch_size=cfg.transfer_chunk_size, **kwargs)
        else:
            self._odb_chunk_sampler = ChunkSampler(self.sampler, cfg.transfer_chunk_size,
                                                   cfg.transfer_chunk_size * CHUNK_GROWTH)
            inner = DataLoader(IndexedDataset(self.dataset, self._odb_transform),
                               batch_sampler=self._odb_chunk_sampler, **kwargs)
        if self.persistent_workers:
            self._odb_inner = inner
        return inner

    def _odb_source(self, skip: int = 0, order: Optional[Sequence[int]] = None,
                    stream: Optional[Dict[str, Any]] = None) -> Tuple[SampleSource, Optional[StreamMarks]]:
        """The epoch's sample source (from position ``skip`` of ``order``, default the sampler's; an
        iterable stream from its saved restart point) and the stream's restart points, if it has state."""
        cfg = self._odb_cfg
        inner = self._odb_inner_loader()
        if self._odb_chunk_sampler is not None:
            self._odb_chunk_sampler.skip, self._odb_chunk_sampler.order = skip, order
        packed = self.num_workers > 0
        meter = SampleMeter(cfg)
        watch = WorkerWatch()
        if not self._odb_is_iterable():
            batches = watch.follow(iter(inner))  # workers start here
            chunks: Iterator[Any] = (unpack_records(c, packed, meter) for c in batches)
            marks = None
        else:
            first, marks, wrapper = (stream["start"] if stream else 0), None, self._odb_stream
            if wrapper is not None:
                wrapper.start = stream["states"] if stream else None
                marks = StreamMarks(first, wrapper.start, self.num_workers)
            batches = watch.follow(iter(inner))  # workers start here, on this thread, each with its copy of the wrapper
            if wrapper is not None:
                wrapper.start = None
            chunks = stream_records(batches, packed, meter, first, marks.on_chunk if marks is not None else None)
        chunks = self._odb_label_check.wrap(chunks)  # warns when target labels go unbudgeted
        return SampleSource(chunks, cap_samples=cfg.buffer_size, cap_tokens=cfg.window_tokens,
                            threaded=cfg.ready_batches > 0, watch=watch), marks

    @staticmethod
    def _odb_pin(batch: Any) -> Any:
        return _pin(batch)

    def _odb_estimate_steps(self) -> int:
        """Steps per epoch, from known lengths or a probe of the dataset read once (odb.plan.estimate)."""
        cfg = self._odb_cfg
        if self._odb_is_iterable():
            raise TypeError("len() of an odb loader over an IterableDataset is known only after one epoch. "
                            "Fix: iterate one epoch first, or use max_steps in the trainer.")
        n, total = len(self.sampler), len(self.dataset)
        world_size = self._odb_world()[1]
        if n == 0 or total == 0:
            return 0
        lengths = self._odb_lengths
        columns = getattr(self.dataset, "column_names", None)
        if lengths is None and isinstance(columns, list) and "length" in columns:
            lengths = np.asarray(self.dataset["length"])  # a datasets.Dataset with a length column
        if lengths is None:
            lengths = self._odb_first_window(n)
        if lengths is None:
            lengths = probe_lengths(self.dataset, self._odb_transform, cfg, self._odb_workers())
        check_probed_fit(lengths, cfg, "len(loader) measured the dataset's samples",
                         total if self._odb_lengths is not None else None)  # known lengths: by index
        return max(1, estimate_steps(np.asarray(lengths), n, cfg, world_size=world_size))

    def _odb_first_window(self, n: int) -> Optional[np.ndarray]:
        """Lengths of the next epoch's first samples, read by that epoch's own source and kept for its
        iteration (no sample is read twice), as many as ``probe_size`` asks for; None where they are no
        uniform sample of the data (the sampler does not shuffle), where ranks would each see their own
        (under DDP len() must agree on every rank: the probe reads the same samples on each), or where an
        epoch is under way or a resume is pending."""
        shuffled = self._odb_own_sampler is not None or shuffles(self)
        if not shuffled or self._odb_world()[1] > 1 or self._odb_resume is not None or \
                (self._odb_pipeline is not None and not self._odb_pipeline.done):
            return None
        epoch = self._odb_next_epoch
        if self._odb_prepared is None or self._odb_prepared[:2] != self._odb_sampler_epoch(epoch):
            self._odb_drop_prepared()
            if self._odb_own_sampler is not None:
                self._odb_own_sampler.set_epoch(epoch)
            source, marks = self._odb_source()
            self._odb_prepared = self._odb_sampler_epoch(epoch) + (source, marks)
            weakref.finalize(self, source.close)  # a loader dropped without iterating lets go of its workers
        source = self._odb_prepared[2]
        want = min(DEFAULT_PROBE, n)
        try:
            while True:
                lengths = np.array([meta[0] for meta in source.peek(want)], dtype=np.int64)
                need = probe_size(lengths, n, self._odb_cfg)
                if need <= len(lengths) or len(lengths) < want or want >= n:
                    return lengths
                want = need
        except BaseException:
            self._odb_drop_prepared()
            raise

    def _odb_sampler_epoch(self, epoch: int) -> Tuple[int, Any]:
        """What fixes the order of the next epoch: odb's epoch and the sampler's own."""
        return epoch, getattr(self.sampler, "epoch", None)

    def _odb_take_prepared(self, epoch: Optional[int]) -> Optional[Tuple[SampleSource, Optional[StreamMarks]]]:
        """The source len() started for this epoch, if it still reads this epoch's order (else closed)."""
        prepared, self._odb_prepared = self._odb_prepared, None
        if prepared is None:
            return None
        if epoch is not None and prepared[:2] == self._odb_sampler_epoch(epoch):
            return prepared[2], prepared[3]
        prepared[2].close()
        return None

    def _odb_drop_prepared(self) -> None:
        prepared, self._odb_prepared = self._odb_prepared, None
        if prepared is not None:
            prepared[2].close()

    def _odb_workers(self) -> Workers:
        return Workers(self.num_workers, self.multiprocessing_context, self.worker_init_fn)


def _is_sharded(sampler: Any) -> bool:
    return hasattr(sampler, "num_replicas") and getattr(sampler, "num_replicas", 1) > 1


def _pin(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.pin_memory()
    if isinstance(obj, Mapping):
        if type(obj) is dict:
            return {k: _pin(v) for k, v in obj.items()}
        for k in list(obj.keys()):  # dict-like batch types (e.g. BatchEncoding) keep their type
            obj[k] = _pin(obj[k])
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_pin(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_pin(v) for v in obj)
    return obj


class ODBDataLoader(ODBLoaderMixin):
    """A DataLoader whose batches hold as many samples as fit ``token_budget``.

    Every DataLoader argument keeps its meaning; ``batch_size`` must stay 1 (the
    budget decides the batch size). ``shuffle=True`` shuffles the samples (seeded, per
    epoch) and the batch order within each window; with a ``sampler`` (which, as in
    torch, excludes ``shuffle=True``) the batch order is shuffled when the sampler
    shuffles. ``in_order=False`` is refused (odb reads samples in sampler order). ODB
    options are ODBConfig fields, given as keyword arguments or as ``config=``. Each
    batch carries an ``ODBStepInfo`` (see ``odb.pop_step_info``).

    Example:
        >>> import torch, odb
        >>> data = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (5, 3, 8, 2)]
        >>> loader = odb.ODBDataLoader(data, token_budget=16, buffer_size=4, collate_fn=list)
        >>> sorted(len(odb.pop_step_info(b).sample_ids) for b in loader)
        [2, 2]
    """

    def __init__(self, dataset: Any, token_budget: Any = None, *, config: Optional[ODBConfig] = None,
                 batch_size: Optional[int] = 1, shuffle: Optional[bool] = None, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0, collate_fn: Optional[Callable] = None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Optional[Callable] = None, multiprocessing_context: Any = None,
                 generator: Optional[torch.Generator] = None, prefetch_factor: Optional[int] = None,
                 persistent_workers: bool = False, pin_memory_device: str = "",
                 lengths: Optional[Sequence[int]] = None, process_group: Any = None, **options: Any) -> None:
        dl_options = {k: options.pop(k) for k in list(options) if k == "in_order"}
        cfg = make_config(config, token_budget, options, "ODBDataLoader", _LOADER_ARGS,
                          "ODBDataLoader takes odb.ODBConfig fields and DataLoader arguments")
        check_inputs(cfg, lengths, dl_options.get("in_order", True))
        if batch_size != 1 or batch_sampler is not None:
            what = f"batch_sampler={batch_sampler!r}" if batch_sampler is not None else f"batch_size={batch_size!r}"
            raise ValueError(f"ODBDataLoader got {what}: odb decides each batch's size from token_budget. "
                             f"Fix: leave batch_size at 1 (cap samples per batch with max_batch_size=N).")
        iterable = isinstance(dataset, IterableDataset)
        if iterable and sampler is not None:
            raise ValueError(f"ODBDataLoader got sampler={sampler!r} with an IterableDataset, which has no indices. "
                             f"Fix: drop sampler; shard and order inside the dataset.")
        if shuffle and sampler is not None:
            raise ValueError(f"ODBDataLoader got shuffle=True with sampler={type(sampler).__name__}: the sampler "
                             f"decides the order (torch's DataLoader refuses this too). Fix: drop shuffle (odb "
                             f"shuffles its batch order when the sampler shuffles, e.g. DistributedSampler or "
                             f"odb.ShardSampler with shuffle=True), or drop sampler.")
        seed = cfg.seed if cfg.seed is not None else draw_seed(generator, sampler)
        if collate_fn is None and cfg.layout == "packed":
            collate_fn = PackedCollate(ignore_index=cfg.ignore_index)  # one padding-free row per batch
        own = None
        if shuffle and sampler is None and not iterable:
            own = sampler = EpochShuffleSampler(dataset, seed)
        super().__init__(dataset, batch_size=1, shuffle=None, sampler=sampler, num_workers=num_workers,
                         collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
                         worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                         generator=generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers, pin_memory_device=pin_memory_device, **dl_options)
        batch_order = shuffles(self) if shuffle is None else bool(shuffle)  # with a sampler: as it does
        self._odb_setup(cfg, shuffle=batch_order, seed=seed, group_collate=self.collate_fn,
                        sample_transform=None, own_sampler=own, lengths=lengths, process_group=process_group)


def group_collate_for(loader: DataLoader, collate_fn: Optional[Callable]) -> tuple:
    """(group collate, per-sample transform) for a loader built with batch_size 1 or None."""
    if loader.batch_size == 1:
        return (collate_fn or loader.collate_fn), None
    return (collate_fn or default_collate), loader.collate_fn


def shuffles(loader: DataLoader) -> bool:
    """Whether a loader's sampler shuffles (RandomSampler or a sampler with shuffle=True)."""
    sampler = getattr(loader, "sampler", None)
    return isinstance(sampler, RandomSampler) or bool(getattr(sampler, "shuffle", False))
