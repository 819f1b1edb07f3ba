"""The read stage: processed single samples from the inner DataLoader, read a window ahead.

Workers measure each sample (lengths, supervised tokens, image patches) next to the
user's pipeline, so the main process never walks a sample to find its length. A reader
thread pulls the workers' chunks into a buffer bounded by one full window (samples and
tokens), so the workers keep working while the current window trains; the window stage
takes samples from it in arrival order.

Every record names its sample by its position in the epoch's order (the sampler's
order for map-style data, the arrival order of an IterableDataset): positions are
unique within an epoch even when the sampler repeats a dataset index.
"""

from __future__ import annotations

import collections
import itertools
import threading

import torch
from typing import Any, Callable, Deque, Iterable, Iterator, List, Optional, Tuple

from odb.config import ODBConfig
from odb.data.declared import check_length_fn, which
from odb.data.lengths import SampleLengthError, as_length_tuple, count_loss_tokens, default_length, image_patches
from odb.data.sampling import pack_chunk, unpack_chunk
from odb.data.worker_deaths import WorkerWatch

# (lengths, supervised tokens, image patches) of one sample.
Meta = Tuple[Tuple[int, ...], int, int]
# (position in the epoch's order, dataset index (the position for an IterableDataset), sample, meta)
Record = Tuple[int, int, Any, Meta]


# A packed chunk's buffers up to this size travel inside the message, as bytes; larger ones through
# shared memory. Handing over a shared-memory buffer takes round trips to the worker's resource-sharer
# thread (and, for a busy worker, a wait for its GIL each time): it cost more than copying a few
# hundred kilobytes through the pipe, in the worker and in the main process.
INLINE_MAX_BYTES = 4 << 20


def to_wire(packed: Any) -> Any:
    """A packed chunk (odb.data.sampling.pack_chunk) with its small buffers turned into bytes.

    Example:
        >>> import torch
        >>> t = torch.arange(3)
        >>> skeleton, buffers, specs = from_wire(to_wire(([0], {torch.int64: t}, [])))
        >>> buffers[torch.int64].tolist()
        [0, 1, 2]
    """
    skeleton, buffers, specs = packed
    wire = {d: (b.view(torch.uint8).numpy().tobytes() if b.numel() * b.element_size() <= INLINE_MAX_BYTES else b)
            for d, b in buffers.items()}
    return skeleton, wire, specs


def from_wire(packed: Any) -> Any:
    """The packed chunk that ``to_wire`` sent (bytes become tensors again)."""
    skeleton, wire, specs = packed
    buffers = {d: (_from_bytes(b, d) if isinstance(b, bytes) else b) for d, b in wire.items()}
    return skeleton, buffers, specs


def _from_bytes(data: bytes, dtype: torch.dtype) -> torch.Tensor:
    if not data:  # frombuffer refuses an empty buffer
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)


class SourceClosed(RuntimeError):
    """The epoch was abandoned while its producer waited for samples."""


class SampleMeter:
    """What odb needs to know of one processed sample; picklable, so it runs in the workers.

    Example:
        >>> SampleMeter(ODBConfig(token_budget=8))(0, {"input_ids": [1, 2, 3], "labels": [1, -100, 3]})
        ((3,), 2, 0)
    """

    def __init__(self, cfg: ODBConfig) -> None:
        self.length_fn = cfg.length_fn or default_length
        # A length_fn of the user's may read a stored length column: each sample's input_ids are checked against it
        self.declared = cfg.length_fn is not None
        self.loss_tokens_fn = cfg.loss_tokens_fn
        self.label_key, self.ignore_index, self.shift_labels = cfg.label_key, cfg.ignore_index, cfg.shift_labels
        self.patches_key = cfg.image_patches_key
        # A packed row masks each sample's first label and the model shifts labels inside: labels[1:] count.
        self.packed = cfg.layout == "packed"

    def __call__(self, sid: Optional[int], sample: Any) -> Meta:
        try:
            lengths = as_length_tuple(self.length_fn(sample), -1 if sid is None else sid)
        except SampleLengthError as err:
            raise SampleLengthError(f"{which(sid)}: {err}") from None
        if self.declared:
            check_length_fn(sid, lengths, sample)
        if self.loss_tokens_fn is not None:
            loss = int(self.loss_tokens_fn(sample))
        else:
            loss = int(count_loss_tokens(sample, self.label_key, self.ignore_index, self.shift_labels or self.packed,
                                         fallback=max(lengths[0] - self.packed, 0)))
        patches = image_patches(sample, self.patches_key) if self.patches_key else 0
        return lengths, loss, patches


class ChunkCollate:
    """Collate of the inner loader: a chunk of ``(position, index, sample)`` items (or bare samples
    of an IterableDataset; ``(tag, sample)`` pairs when ``tagged``, see odb.data.stream_state) becomes
    ``(positions, indices, metas, samples, tag)``, the samples packed into one buffer per dtype
    when ``pack`` (they cross a process boundary). Iterable chunks have no positions yet (None).

    Example:
        >>> ChunkCollate(None, indexed=True, pack=False)([(0, 7, "a"), (1, 7, "b")])
        ([0, 1], [7, 7], None, ['a', 'b'], None)
    """

    def __init__(self, meter: Optional[SampleMeter], indexed: bool, pack: bool, metas_only: bool = False,
                 tagged: bool = False) -> None:
        self.meter, self.indexed, self.pack, self.metas_only = meter, indexed, pack, metas_only
        self.tagged = tagged

    def __call__(self, items: List[Any]) -> Any:
        tag = None
        if self.indexed:
            positions: Optional[List[int]] = [int(p) for p, _, _ in items]
            indices: List[Optional[int]] = [int(i) for _, i, _ in items]
            samples = [s for _, _, s in items]
        else:
            if self.tagged:  # the stream's resume point rides on the chunk's last sample
                tag = next((t for t, _ in reversed(items) if t is not None), None)
                items = [s for _, s in items]
            positions, indices, samples = None, [None] * len(items), list(items)
        metas = None if self.meter is None else [self.meter(i, s) for i, s in zip(indices, samples)]
        if self.metas_only:  # a length probe: the samples stay in the worker
            return positions, indices, metas, None, tag
        return positions, indices, metas, (to_wire(pack_chunk(samples)) if self.pack else samples), tag


def unpack_records(chunk: Any, packed: bool, meter: Optional[SampleMeter], first: int = 0) -> List[Record]:
    """The records of one chunk that came out of ``ChunkCollate`` (metering here if workers did not).

    An iterable chunk's samples are numbered from ``first`` (their arrival positions)."""
    positions, indices, metas, samples, _ = chunk
    if packed:
        samples = unpack_chunk(from_wire(samples))
    if metas is None:
        metas = [meter(i, s) for i, s in zip(indices, samples)]
    if positions is None:
        positions = indices = range(first, first + len(samples))
    return list(zip(positions, indices, samples, metas))


def stream_records(chunks: Iterable[Any], packed: bool, meter: Optional[SampleMeter], first: int = 0,
                   on_chunk: Optional[Callable[[int, int, Any], None]] = None) -> Iterator[List[Record]]:
    """Records of an IterableDataset's chunks, numbered by arrival position from ``first``.

    ``on_chunk(start, count, tag)`` hears of every chunk (odb.data.stream_state keeps resume points)."""
    position = first
    for chunk in chunks:
        records = unpack_records(chunk, packed, meter, position)
        if on_chunk is not None:
            on_chunk(position, len(records), chunk[4])
        position += len(records)
        yield records


class SampleSource:
    """Records in arrival order, read ahead by a thread into a buffer bounded by one window.

    ``take(max_samples, max_tokens)`` returns the next window's records: up to
    ``max_samples``, closing with the record that brings it to ``max_tokens`` real tokens.
    """

    def __init__(self, chunks: Iterable[List[Record]], *, cap_samples: int, cap_tokens: Optional[int],
                 threaded: bool, on_close: Optional[Callable[[], None]] = None,
                 watch: Optional[WorkerWatch] = None) -> None:
        self._chunks: Iterator[List[Record]] = iter(chunks)
        self.watch = watch if watch is not None else WorkerWatch()  # the inner loader's workers
        self._cap_samples, self._cap_tokens = cap_samples, cap_tokens
        self._buf: Deque[Record] = collections.deque()
        self._buf_tokens = 0
        self._ended = False
        self._error: Optional[BaseException] = None
        self._closed = False
        self._on_close = on_close
        self.peak_samples = 0
        self.peak_tokens = 0
        self._hold = 0  # records read past the caps until the first take (what peek asked for)
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        if threaded:
            self._thread = threading.Thread(target=self._read_all, name="odb-reader", daemon=True)
            self._thread.start()

    # ---- the reader ------------------------------------------------------------------
    def _full(self) -> bool:
        return (len(self._buf) >= self._cap_samples or (self._cap_tokens is not None
                                                       and self._buf_tokens >= self._cap_tokens)) \
            and len(self._buf) >= self._hold

    def _read_all(self) -> None:
        try:
            for chunk in self._chunks:
                with self._cond:
                    while self._full() and not self._closed:
                        self._cond.wait()
                    if self._closed:
                        return
                    self._add(chunk)
                    self._cond.notify_all()
        except BaseException as err:  # handed to the consumer, raised on the training thread
            with self._cond:
                self._error = err
        finally:
            with self._cond:
                self._ended = True
                self._cond.notify_all()

    def _add(self, chunk: List[Record]) -> None:
        for record in chunk:
            self._buf.append(record)
            self._buf_tokens += sum(record[3][0])
        self.peak_samples = max(self.peak_samples, len(self._buf))
        self.peak_tokens = max(self.peak_tokens, self._buf_tokens)

    def _read_one_chunk(self) -> None:
        # Unthreaded: the caller reads on demand.
        try:
            self._add(next(self._chunks))
        except StopIteration:
            self._ended = True

    # ---- the consumer ----------------------------------------------------------------
    def _enough(self, max_samples: int, max_tokens: Optional[int]) -> bool:
        if self._ended or self._closed or len(self._buf) >= max_samples or self._full():
            return True
        return max_tokens is not None and self._buf_tokens >= max_tokens

    def peek(self, count: int) -> List[Meta]:
        """The metas of the first ``count`` records (fewer when the data ends first), read now and kept for
        ``take``: the buffer holds at least that many until the first take, whatever its caps."""
        with self._cond:
            self._check_open()
            self._hold = max(self._hold, count)
            self._cond.notify_all()
            self._fill_until(lambda: len(self._buf) >= count or self._ended or self._closed)
            self._check_open()
            self._raise()
            return [record[3] for record in itertools.islice(self._buf, count)]

    def _fill_until(self, done: Callable[[], bool]) -> None:
        """Until ``done()``: read a chunk here (no reader thread) or wait for the reader (holding the lock)."""
        while not done():
            if self._thread is None:
                self._read_one_chunk()
            else:
                self._cond.wait()

    def take(self, max_samples: int, max_tokens: Optional[int]) -> Tuple[List[Record], bool]:
        """The next window's records, and whether the data ends with them."""
        with self._cond:
            self._check_open()
            self._hold = 0
            self._fill_until(lambda: self._enough(max_samples, max_tokens))
            self._raise()
            out: List[Record] = []
            tokens = 0
            while self._buf and len(out) < max_samples and (max_tokens is None or tokens < max_tokens):
                rec = self._buf.popleft()
                n = sum(rec[3][0])
                tokens += n
                self._buf_tokens -= n
                out.append(rec)
            self._cond.notify_all()
            # Knowing that this window is the last lets the planner flush it instead of
            # carrying samples into a window that never comes.
            self._fill_until(lambda: bool(self._buf) or self._ended or self._closed)
            self._check_open()
            self._raise()
            return out, self._ended and not self._buf

    def skip(self, count: int, wanted: Iterable[int]) -> dict:
        """Drop the next ``count`` records (a resumed iterable epoch), keeping the wanted ones:
        position -> (index, sample, meta)."""
        want = set(wanted)
        found = {}
        while count > 0:
            recs, _ = self.take(count, None)
            if not recs:
                break
            for position, index, sample, meta in recs:
                if position in want:
                    found[position] = (index, sample, meta)
            count -= len(recs)
        missing = want - set(found)
        if missing:
            raise ValueError(f"odb resume: the dataset stream ended before samples {sorted(missing)[:5]} "
                             f"reappeared: the IterableDataset does not replay the same stream. Fix: make its "
                             f"order deterministic (seeded) so it can be resumed.")
        return found

    def _check_open(self) -> None:
        if self._closed:
            raise SourceClosed("odb's sample source was closed (the epoch's iteration ended)")

    def _raise(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            self._ended = True
            raise err

    def close(self) -> None:
        """Stop reading and let go of the inner loader (and so of its worker processes)."""
        died = self.watch.failure() is not None
        self.watch.stop()
        with self._cond:
            self._closed = True
            self._buf.clear()
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread() and not died:
            # The reader may be inside the inner loader's next(); it returns within one chunk (after a worker
            # died, only when torch's check of its workers runs, up to 5 s later: not waited for).
            thread.join(timeout=5.0)
        self._chunks = iter(())
        if self._on_close is not None:
            self._on_close()
