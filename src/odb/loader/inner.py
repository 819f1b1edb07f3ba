"""The inner torch DataLoaders that read for an odb loader (one builder, two shapes).

Online planning reads chunks of samples (``online``): the workers load and measure
samples, odb plans and collates on the main process. Known lengths (``known``): odb
plans first and hands the plan to the inner loader as its batch sampler, so the workers
load and collate whole batches. Both take the outer loader's worker settings
(``num_workers``, ``timeout``, ``worker_init_fn``, ``multiprocessing_context``,
``generator``, ``persistent_workers``, ``prefetch_factor``, ``in_order``; the context records the
workers it starts, odb.data.worker_processes); with
``persistent_workers`` the inner loader, and so its workers, lives across epochs.

Example:
    >>> import numpy as np, torch
    >>> from torch.utils.data import DataLoader
    >>> outer = DataLoader([{"input_ids": torch.ones(3)}] * 4, batch_size=1)
    >>> inner = InnerLoaders(outer, None).known(list, ODBConfig(token_budget=8), DeclaredLengths(np.ones((4, 1))))
    >>> inner.num_workers, inner.persistent_workers
    (0, False)
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional

from torch.utils.data import DataLoader, IterableDataset

from odb.config import ODBConfig
from odb.data.declared import DeclaredDataset, DeclaredLengthCheck, DeclaredLengths
from odb.data.sampling import ChunkSampler, IndexedDataset, TransformedIterable
from odb.data.source import ChunkCollate, SampleMeter
from odb.data.stream_state import StatefulStream, has_own_state
from odb.data.worker_processes import recording_context
from odb.epoch.known import GroupCollate, PlannedBatchSampler
from odb.loader.length_probe import Workers, meter_for_workers

# Chunks from the workers grow to this many times transfer_chunk_size (odb.data.sampling.ChunkSampler).
CHUNK_GROWTH = 8
_HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters


class InnerLoaders:
    """Builds (and, with persistent workers, keeps) the inner loader of ``loader``, an odb loader.

    ``chunk_sampler`` (map-style online reading) and ``stream`` (an IterableDataset with its
    own state, wrapped) are set by ``online`` for the epoch's source to steer.
    """

    def __init__(self, loader: DataLoader, transform: Optional[Callable[[Any], Any]]) -> None:
        self.loader, self.transform = loader, transform
        self.persistent: Optional[DataLoader] = None  # the inner loader kept across epochs (persistent_workers)
        self.chunk_sampler: Optional[ChunkSampler] = None
        self.stream: Optional[StatefulStream] = None

    def workers(self) -> Workers:
        """The outer loader's worker settings, for the length probe."""
        outer = self.loader
        return Workers(outer.num_workers, outer.multiprocessing_context, outer.worker_init_fn)

    def online(self, cfg: ODBConfig) -> DataLoader:
        """The inner loader of online planning: chunks of ``cfg.transfer_chunk_size`` samples with their
        measures (an IterableDataset's own chunks; a map-style dataset's through ``chunk_sampler``)."""
        if self.persistent is not None:
            return self.persistent
        outer = self.loader
        packed = outer.num_workers > 0
        meter = meter_for_workers(SampleMeter(cfg), self.workers())
        if isinstance(outer.dataset, IterableDataset):
            dataset: Any
            if has_own_state(outer.dataset):  # resumable through its own state: tag chunks with it
                dataset = self.stream = StatefulStream(outer.dataset, self.transform, cfg.transfer_chunk_size)
                collate = ChunkCollate(meter, indexed=False, pack=packed, tagged=True)
            else:
                dataset = outer.dataset if self.transform is None else TransformedIterable(outer.dataset,
                                                                                           self.transform)
                collate = ChunkCollate(meter, indexed=False, pack=packed)
            return self._build(dataset, collate, pin=False, batch_size=cfg.transfer_chunk_size)
        self.chunk_sampler = ChunkSampler(outer.sampler, cfg.transfer_chunk_size,
                                          cfg.transfer_chunk_size * CHUNK_GROWTH)
        return self._build(IndexedDataset(outer.dataset, self.transform), ChunkCollate(meter, indexed=True, pack=packed),
                           pin=False, batch_sampler=self.chunk_sampler)

    def known(self, group_collate: Callable[[Any], Any], cfg: ODBConfig, declared: DeclaredLengths) -> DataLoader:
        """The inner loader of known lengths: whole planned batches, collated (and pinned) in the workers, each
        sample checked against its ``declared`` lengths as ``cfg``'s length_fn measures it."""
        if self.persistent is not None:
            return self.persistent
        collate = GroupCollate(group_collate, self.transform, DeclaredLengthCheck(cfg.length_fn))
        return self._build(DeclaredDataset(self.loader.dataset), collate, pin=True,
                           batch_sampler=PlannedBatchSampler(declared.keys))

    def forget(self) -> None:
        """Drop the kept inner loader (its workers hold a stale copy of a stream's state)."""
        self.persistent = None

    def _build(self, dataset: Any, collate_fn: Callable[[Any], Any], pin: bool, **batching: Any) -> DataLoader:
        outer = self.loader
        kwargs: Dict[str, Any] = dict(
            num_workers=outer.num_workers, collate_fn=collate_fn, timeout=outer.timeout,
            worker_init_fn=outer.worker_init_fn, generator=outer.generator, persistent_workers=outer.persistent_workers,
            prefetch_factor=outer.prefetch_factor if outer.num_workers > 0 else None)
        if outer.num_workers > 0:  # the user's start method, its workers recorded for odb's watch
            kwargs["multiprocessing_context"] = recording_context(outer.multiprocessing_context)
        if pin:  # known lengths: the workers' batches are final, the inner loader pins them
            kwargs.update(pin_memory=outer.pin_memory, pin_memory_device=getattr(outer, "pin_memory_device", ""))
        else:  # online: odb pins its own collated batches
            kwargs["pin_memory"] = False
        if _HAS_IN_ORDER:
            kwargs["in_order"] = getattr(outer, "in_order", True)
        inner = DataLoader(dataset, **batching, **kwargs)
        if outer.persistent_workers:
            self.persistent = inner
        return inner
