"""LoaderCore: the state and lifecycle of one odb loader, the object the DataLoader delegates to.

``ODBDataLoader`` and loaders converted by ``odb.apply`` keep one attribute, the core. It holds
the loader's budget (odb.epoch.budget, made from the user's options by odb.loader.budgets), the
epoch under way (``under_way``: its run, cursor, pipeline and mode, built by odb.loader.assembly
from the sources of odb.loader.sources), the epoch counts (``counts``: the next epoch or the
state it resumes, the step count ``len()`` reports; both odb.loader.epoch_state), the OOM
counters, and answers the loader's public methods (saved states: odb.resume.loader_state).

An epoch runs in one of two modes, chosen by whether the loader knows every sample's
length up front (``lengths=``): ``OnlineEpoch`` (a background thread reads samples through
the inner loader, plans and collates) or ``KnownLengthsEpoch`` (the plan becomes the inner
loader's batch sampler; its workers collate whole batches): odb.loader.epoch_modes.

Example:
    >>> import torch, odb
    >>> loader = odb.ODBDataLoader([{"input_ids": torch.ones(3)}] * 4, token_budget=8, collate_fn=list)
    >>> core = loader.odb_core
    >>> core.world(), core.cfg.token_budget
    ((0, 1), 8)
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple, Union

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from odb.arguments import check_in_order
from odb.comm.protocol import ExchangeFactory
from odb.config_rules import check_composition
from odb.config import ODBConfig
from odb.data.batch_shard import BatchShardSampler
from odb.data.bucket_collate import PadToBucket
from odb.packed.collate import check_context_collate
from odb.data.collate_check import PaddingHint
from odb.data.lengths import check_length_dims
from odb.data.sampling import EpochShuffleSampler, ShardSampler
from odb.epoch.drop_last import DropLast
from odb.epoch.auto import AutoControl
from odb.epoch.run import EpochRun
from odb.epoch.stats import EpochStats
from odb.loader.assembly import EpochAssembly
from odb.loader.batch_checks import BatchChecks
from odb.loader.budgets import make_budget
from odb.loader.epoch_state import EpochCounts, EpochUnderWay
from odb.loader.inner import InnerLoaders
from odb.loader.length_probe import check_probed_fit, probe_lengths
from odb.loader.sources import EpochSources
from odb.plan.windows.estimate import estimate_steps
from odb.resume.loader_state import PlanOptions, loader_fields, saved_state, state_to_resume


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
                 exchanges: Optional[ExchangeFactory] = None, batch_unit: Optional[int] = None) -> None:
        check_in_order(getattr(loader, "in_order", True))
        check_length_dims(cfg.token_budgets, cfg.length_fn, lengths)
        # The loader holds this core; the core and its parts hold the loader weakly. Held strongly, the loader
        # would sit in a reference cycle that only the garbage collector frees, and the collector finalizes a
        # torch iterator's queues before the iterator: its workers never hear that they are done, and the
        # collection waits 5 s per worker before torch kills them. A loader freed by its count lets go of its
        # workers at once (``release``).
        owner, loader = loader, weakref.proxy(loader)
        self.loader = loader
        # The window budget (odb.epoch.budget): fixed, scheduled or token_budget="auto"; it holds the options
        self.budget = make_budget(cfg, lengths)
        # drop_last with global_batch_size drops a rank's partial last batch of the user's (``batch_unit``
        # samples: the batch_size they wrote), or the whole partial last step where no batch size is known
        self.drops = DropLast(bool(loader.drop_last), batch_unit)
        self.seed = seed
        if cfg.layout == "padded" and (cfg.shape_buckets is not None or cfg.context_parallel > 1) and \
                not isinstance(group_collate, PadToBucket):
            # odb plans each batch at a bucket length (and, under context parallelism, at a multiple of what its
            # sharding needs); the collate pads to the longest sample: pad on to the bucket, the multiple
            group_collate = PadToBucket(group_collate, cfg.shape_buckets or (), ignore_index=cfg.ignore_index,
                                        multiple=cfg.length_multiple if cfg.context_parallel > 1 else 1)
        check_context_collate(cfg, group_collate)
        self.transform = sample_transform
        self.own_sampler = own_sampler
        self.inner = InnerLoaders(loader, sample_transform)
        self.sources = EpochSources(loader, self.inner, self.budget, own_sampler, lengths)
        self.assembly = EpochAssembly(loader, sources=self.sources, inner=self.inner, budget=self.budget,
                                      # a collate that cannot pad says so; a batch of empty samples is widened
                                      group_collate=PaddingHint(group_collate, cfg.ignore_index),
                                      transform=sample_transform, exchanges=exchanges, shuffle=shuffle,
                                      notices=set(),  # warnings the loader's epochs give once
                                      drops=self.drops)
        self.under_way = EpochUnderWay()  # the current (or last) epoch: its run, cursor, pipeline and mode
        self.counts = EpochCounts()  # the next epoch's number (or the state it resumes), an epoch's steps
        self.oom: Optional[Any] = None
        # warns once: a forgotten pop_step_info, labels that need shift_labels; refuses a batch over the budget
        budget = self.budget
        self.checks = BatchChecks(cfg, lambda: budget.options)
        self.plan_options = PlanOptions()
        cfg.step_samples(self.world()[1])  # refuses a global_batch_size that the ranks cannot share, now
        check_composition(cfg)
        weakref.finalize(owner, self.release)

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
        """``odb_stats``: this epoch's counters up to the last batch handed out, plus OOM counters and the samples
        that loaded shorter than their declared ``lengths=`` (since the loader was built)."""
        cursor, mode, run = self.under_way.cursor, self.under_way.mode, self.under_way.run
        stats = dataclasses.replace(cursor.stats) if cursor is not None else EpochStats()
        stats.wait_s = self.wait_s(stats.wait_s)
        if mode is not None:
            stats.loss_tokens = mode.loss_tokens(stats.loss_tokens)
        if run is not None:
            stats.read_ahead_max = run.source.peak_samples
            stats.read_ahead_tokens_max = run.source.peak_tokens
        out = stats.as_dict()
        if self.oom is not None:
            out.update({k if k.startswith("oom") else f"oom_{k}": v for k, v in self.oom.as_dict().items()})
        out.update(self.budget.stats(run.budget if run is not None else None))
        declared = self.sources.declared
        out["shorter_than_declared"] = declared.shorter.count if declared is not None else 0
        return out

    def oom_counters(self) -> Any:
        """``odb_oom_counters``: made on first use."""
        if self.oom is None:
            from odb.train.oom import OOMCounters

            self.oom = OOMCounters()
            self.oom.on_oom = self.budget.on_oom  # odb.train.oom tells of an out-of-memory batch: auto learns it
            if self.assembly.exchanges is not None and self.assembly.exchanges.processes() > 1:
                self.oom.exchanges = self.assembly.exchanges  # (the fallback agrees over the loader's ranks)
        return self.oom

    def wait_s(self, default: float = 0.0) -> float:
        """Seconds the training loop waited in next() this epoch (``default`` before any epoch)."""
        mode = self.under_way.mode
        return mode.wait_s() if mode is not None else default

    def abort(self, reason: "BaseException | str") -> None:
        """``odb_abort``: stop this epoch and tell the other ranks."""
        error = reason if isinstance(reason, BaseException) else RuntimeError(str(reason))
        if self.under_way.pipeline is not None:
            self.under_way.pipeline.abort(error)
        self.stop()

    def set_token_budget(self, token_budget: Any) -> None:
        """``set_token_budget``: from the next planning window on."""
        self.budget.set_token_budget(token_budget)  # the next windows plan under it (token_budget="auto" refuses)
        self.counts.estimate = None

    def set_epoch(self, epoch: int) -> None:
        """``set_epoch``: odb's epoch, and the sampler's (unless it is odb's own)."""
        self.counts.next_epoch = int(epoch)
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch") and sampler is not self.own_sampler:
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return self.counts.steps(self._estimate_steps)

    def iterate(self) -> Iterator[Any]:
        """``iter(loader)``: start the next epoch (or the resumed one) in its mode (odb.loader.assembly)."""
        self.stop()
        epoch, state = self.counts.start_next()
        if self.own_sampler is not None:
            self.own_sampler.set_epoch(epoch)
        built = self.assembly.build(self, epoch=epoch, seed=self.seed, state=state, previous=self.under_way.mode,
                                    settled=self.under_way.pipeline_done)
        self.under_way.started(built)
        return built.batches

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
            elif isinstance(sampler, BatchShardSampler):  # ranks differ by a batch at most: rank 0's is the largest
                n = sampler.share(0)
        except TypeError:
            return None
        return self.drops.steps(n, g)

    def state_dict(self) -> Dict[str, Any]:
        """``state_dict``: where the loader is, as plain data (odb.resume.loader_state.saved_state)."""
        rank, world_size = self.world()
        counts = self.counts
        return saved_state(self.under_way.run, self.under_way.cursor, finished_epoch=counts.last_steps_epoch,
                           next_epoch=counts.next_epoch, seed=self.seed, wait_s=self.wait_s(),
                           accumulation=self.accumulation(), rank=rank, world_size=world_size, fields=self._fields(),
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
        self.counts.resume = state if state["run"] is not None else None
        self.counts.next_epoch = int(state["epoch"])
        self.budget.load_loader_state(state["budget"], resumed=state["run"] is not None)
        if self.own_sampler is None and hasattr(sampler, "set_epoch"):
            sampler.set_epoch(int(state["epoch"]))  # the saved epoch's order (DistributedSampler, ShardSampler)
        self.stop()
        self.under_way.forget_position()
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
        """(rank, world size) without creating anything (no collective): under a mesh, the data-parallel
        replica's and the number of replicas."""
        return self.assembly.world()

    @property
    def exchange_factory(self) -> Optional[ExchangeFactory]:
        """Where this loader's exchanges come from (None: a local loader)."""
        return self.assembly.exchanges

    def stop(self) -> None:
        """End the previous iteration's background work, if any."""
        under_way = self.under_way
        under_way.pipeline_done = True
        pipeline, run = under_way.pipeline, under_way.run
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
            under_way.pipeline_done = pipeline.close()
            if late is not None:
                raise late

    def release(self) -> None:
        """The loader is gone: end the epoch under way and let go of every worker process (a source that
        ``len()`` kept, the inner loader kept by ``persistent_workers``)."""
        try:
            self.stop()  # (closes the epoch's source)
        finally:
            self.sources.drop_prepared()
            self.inner.forget()

    def epoch_over(self, run: EpochRun) -> None:
        """An epoch ran to its end: its counters are final and its step count is the loader's len()."""
        self.under_way.finished(run)
        self.counts.finished(run)

    def _fields(self) -> Dict[str, Any]:
        loader = self.loader
        return loader_fields(loader.dataset, loader.sampler, loader.num_workers, self.plan_options(self.cfg),
                             self.iterable)

    def _estimate_steps(self) -> int:
        """Steps per epoch, from known lengths or a probe of the dataset read once (odb.plan.windows.estimate)."""
        cfg, dataset, sampler = self.cfg, self.loader.dataset, self.loader.sampler
        if self.iterable:
            raise TypeError("len() of an odb loader over an IterableDataset is known only after one epoch. "
                            "Fix: iterate one epoch first, or use max_steps in the trainer.")
        n, total = len(sampler), len(dataset)
        world_size = self.world()[1]
        if n == 0 or total == 0:
            return 0
        lengths = self.sources.lengths
        columns = getattr(dataset, "column_names", None)
        if lengths is None and isinstance(columns, list) and "length" in columns:
            lengths = np.asarray(dataset["length"])  # a datasets.Dataset with a length column
        if lengths is None:
            lengths = self._first_window(n)
        if lengths is None:
            lengths = probe_lengths(dataset, self.transform, cfg, self.inner.workers())
        run = self.under_way.run
        cfg = self.budget.planning_config(run.budget if run is not None else None, lengths)
        check_probed_fit(lengths, cfg, "len(loader) measured the dataset's samples",
                         total if self.sources.lengths is not None else None)  # known lengths: by index
        return max(1, estimate_steps(np.asarray(lengths), n, cfg, world_size=world_size))

    def _first_window(self, n: int) -> Optional[np.ndarray]:
        """The next epoch's first window, read by its own source (odb.loader.sources.EpochSources.first_window);
        None where ranks would each see their own (under DDP len() must agree on every rank: the probe reads
        the same samples on each), or where an epoch is under way or a resume is pending."""
        pipeline = self.under_way.pipeline
        if self.world()[1] > 1 or self.counts.resume is not None or (pipeline is not None and not pipeline.done):
            return None
        return self.sources.first_window(n, self.counts.next_epoch)
