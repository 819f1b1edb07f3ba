"""What each epoch of a loader reads: its sample source, in the order the epoch needs.

``EpochSources`` makes an epoch's ``SampleSource`` (odb.data.source): over known lengths, index
records; otherwise samples read by the inner loader's workers (odb.loader.inner) with their
measures, from a resumed epoch's position or a stream's saved restart point. ``len()`` may read
the next epoch's first window ahead (``first_window``): that source is kept and the epoch then
reads on from it, so no sample is read twice.

Example:
    >>> import torch, odb
    >>> loader = odb.ODBDataLoader([{"input_ids": torch.ones(n)} for n in (3, 5)], token_budget=8,
    ...                            collate_fn=list, lengths=[3, 5])
    >>> loader.odb_core.sources.known_lengths().ravel().tolist()
    [3, 5]
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from odb.data.declared import DeclaredLengths
from odb.data.lengths import LabelBudgetCheck
from odb.data.sampling import EpochShuffleSampler
from odb.data.source import SampleMeter, SampleSource, stream_records, unpack_records
from odb.data.worker_deaths import WorkerWatch
from odb.data.stream_state import StreamMarks
from odb.epoch.known import known_records
from odb.loader.inner import InnerLoaders
from odb.plan.windows.estimate import DEFAULT_PROBE, probe_size


class EpochSources:
    """The sources of one loader's epochs.

    ``loader``: the DataLoader (its public attributes); ``inner``: its inner loaders; ``budget``: its
    budget (odb.epoch.budget: the options, and how many tokens the read-ahead holds); ``own_sampler``:
    odb's seeded shuffle sampler, if the loader has it; ``lengths``: the known lengths given, if any.
    """

    def __init__(self, loader: DataLoader, inner: InnerLoaders, budget: Any,
                 own_sampler: Optional[EpochShuffleSampler], lengths: Optional[Sequence[Any]]) -> None:
        self.loader, self.inner, self.budget, self.own_sampler = loader, inner, budget, own_sampler
        self.lengths = None if lengths is None else np.asarray(lengths)
        cfg = budget.options
        self.label_check = LabelBudgetCheck(cfg.length_fn, cfg.label_key)
        # The next epoch's source, started by len() to read its first window (SampleSource.peek):
        # (epoch, the sampler's epoch, source, stream marks).
        self.prepared: Optional[Tuple[int, Any, SampleSource, Optional[StreamMarks]]] = None
        known = self.known_lengths()  # refuses lengths that do not match the dataset, now
        # The declared lengths the workers check each loaded sample against, and the tally of shorter ones
        self.declared = DeclaredLengths(known) if known is not None else None

    @property
    def iterable(self) -> bool:
        """Whether the dataset is an IterableDataset."""
        return isinstance(self.loader.dataset, IterableDataset)

    def known_lengths(self) -> Optional[np.ndarray]:
        """(n, D) lengths when odb plans from known lengths (workers then collate whole batches)."""
        lengths, dataset = self.lengths, self.loader.dataset
        if lengths is None or self.iterable or self.budget.options.image_patches_key is not None:
            return None
        lengths = lengths.reshape(len(lengths), -1)
        if len(lengths) != len(dataset):
            raise ValueError(f"odb got lengths= for {len(lengths)} samples but the dataset has "
                             f"{len(dataset)}. Rule: one length (or tuple of lengths) per dataset index, after "
                             f"the dataset's processing. Fix: pass lengths of the processed dataset, in index order.")
        return lengths

    def epoch_total(self) -> Optional[int]:
        """Samples of an epoch on this rank, when the sampler knows (windows ramp down towards the end)."""
        if self.iterable:
            return None
        try:
            return len(self.loader.sampler)
        except TypeError:
            return None

    def for_epoch(self, epoch: int, run_state: Optional[Dict[str, Any]], order: Optional[Sequence[int]],
                  fresh: bool) -> Tuple[SampleSource, Optional[StreamMarks]]:
        """Epoch ``epoch``'s source and its stream's restart points: from the start (``fresh``: a new epoch,
        which may go on from the window ``len()`` read), or where ``run_state`` left it; ``order``: a
        re-partitioned epoch's own order (odb.resume.loader_state.resume_order)."""
        cfg, known = self.budget.options, self.known_lengths()
        position = run_state["position"] if run_state is not None else None
        # A resumed epoch: the consumed prefix of its order is skipped; a re-partitioned one has its own order.
        skip = position["arrived"] if position is not None and not self.iterable else 0
        if known is not None:
            records = known_records(iter(self.loader.sampler) if order is None else order, known, skip)
            return SampleSource(records, cap_samples=cfg.buffer_size, cap_tokens=cfg.window_tokens,
                                threaded=cfg.ready_batches > 0), None
        prepared = self._take_prepared(epoch if fresh else None)  # len() read its first window
        if prepared is not None:
            return prepared
        return self.source(skip=skip, order=order, stream=position["stream"] if position is not None else None)

    def source(self, skip: int = 0, order: Optional[Sequence[int]] = None,
               stream: Optional[Dict[str, Any]] = None) -> Tuple[SampleSource, Optional[StreamMarks]]:
        """The epoch's sample source (from position ``skip`` of ``order``, default the sampler's; an
        iterable stream from its saved restart point) and the stream's restart points, if it has state."""
        cfg, num_workers = self.budget.options, self.loader.num_workers
        inner = self.inner.online(cfg)
        if self.inner.chunk_sampler is not None:
            self.inner.chunk_sampler.next_epoch(skip, order)
        packed = num_workers > 0
        meter = SampleMeter(cfg)
        watch = WorkerWatch()
        if not self.iterable:
            batches = watch.start(inner)  # workers start here
            chunks: Iterator[Any] = (unpack_records(c, packed, meter) for c in batches)
            marks = None
        else:
            first, marks, wrapper = (stream["start"] if stream else 0), None, self.inner.stream
            if wrapper is not None:
                states = stream["states"] if stream else None
                wrapper.start_from(states)
                marks = StreamMarks(first, states, num_workers)
            # workers start here, on this thread, each with its copy of the wrapper
            batches = watch.start(inner)
            if wrapper is not None:
                wrapper.start_from(None)
            chunks = stream_records(batches, packed, meter, first, marks.on_chunk if marks is not None else None)
        chunks = self.label_check.wrap(chunks)  # warns when target labels go unbudgeted
        return SampleSource(chunks, cap_samples=cfg.buffer_size, cap_tokens=self.budget.read_ahead_tokens(),
                            threaded=cfg.ready_batches > 0, watch=watch), marks

    def first_window(self, n: int, epoch: int) -> Optional[np.ndarray]:
        """Lengths of epoch ``epoch``'s first samples, read by that epoch's own source and kept for its
        iteration (no sample is read twice), as many as ``probe_size`` asks for (the epoch has ``n``); None
        where they are no uniform sample of the data (the sampler does not shuffle). The caller asks only
        where this rank's first samples stand for every rank's and no epoch is under way."""
        if self.own_sampler is None and not shuffles(self.loader):
            return None
        if self.prepared is None or self.prepared[:2] != self._sampler_epoch(epoch):
            self.drop_prepared()
            if self.own_sampler is not None:
                self.own_sampler.set_epoch(epoch)
            source, marks = self.source()
            self.prepared = self._sampler_epoch(epoch) + (source, marks)
        source = self.prepared[2]
        want = min(DEFAULT_PROBE, n)
        try:
            while True:
                lengths = np.array([meta[0] for meta in source.peek(want)], dtype=np.int64)
                need = probe_size(lengths, n, self.budget.options)
                if need <= len(lengths) or len(lengths) < want or want >= n:
                    return lengths
                want = need
        except BaseException:
            self.drop_prepared()
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

    def drop_prepared(self) -> None:
        """Close the source ``first_window`` kept, if any."""
        prepared, self.prepared = self.prepared, None
        if prepared is not None:
            prepared[2].close()


def shuffles(loader: DataLoader) -> bool:
    """Whether a loader's sampler shuffles (RandomSampler or a sampler with shuffle=True)."""
    sampler = getattr(loader, "sampler", None)
    return isinstance(sampler, RandomSampler) or bool(getattr(sampler, "shuffle", False))
