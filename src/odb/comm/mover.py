"""The one way odb moves Python objects between ranks: processed samples of a step planned across ranks
(odb.epoch.global_step) and rollout rows of an RL step (odb.integrations.trl.rl_move) alike.

``move_objects`` pickles each rank's outgoing object (``dumps``), moves the bytes through the exchange
(``RankExchange.move``: one gather of sizes, one all-to-all of bytes), unpickles what arrives, and says what
the move cost this rank (``MoveCounts``: objects and bytes sent, bytes received, seconds).

``pickle`` writes a torch tensor with its whole storage, and a view's storage is the tensor it
was cut from. A dataset that returns slices of one large token tensor (a memory-mapped corpus,
``text[start:end]``) would send the whole corpus with every sample: 3.7 MB per sample of a few
hundred tokens, measured on the benchmark's text. ``dumps`` pickles a copy of each tensor whose
storage is larger than its own data, so a sample costs its own bytes; the receiver gets equal
tensors (values, dtype, shape), each with storage of its own.

Example (what ``dumps`` saves):
    >>> import pickle, torch
    >>> corpus = torch.arange(100_000)
    >>> sample = {"input_ids": corpus[10:20]}
    >>> len(pickle.dumps(sample)) > 800_000, len(dumps(sample)) < 2_000
    (True, True)
    >>> pickle.loads(dumps(sample))["input_ids"].tolist() == list(range(10, 20))
    True
"""

from __future__ import annotations

import dataclasses
import io
import pickle
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch

__all__ = ["MoveCounts", "dumps", "move_objects"]


class _CompactPickler(pickle.Pickler):
    """A pickler that writes each tensor view as a copy of its own elements."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.layout == torch.strided and not obj.requires_grad:
            own = obj.numel() * obj.element_size()
            if obj.untyped_storage().nbytes() > own or not obj.is_contiguous():
                return obj.clone(memory_format=torch.contiguous_format).__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """``pickle.dumps(obj)`` (highest protocol), each tensor view written as a copy of its own elements."""
    buffer = io.BytesIO()
    _CompactPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


@dataclasses.dataclass
class MoveCounts:
    """What moving cost one rank: objects sent (each outgoing object's ``len``, or 1), bytes sent and received,
    seconds from the first pickle to the last unpickle."""

    sent: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    seconds: float = 0.0

    def add(self, other: "MoveCounts") -> None:
        """Add ``other``'s counts to these."""
        self.sent += other.sent
        self.sent_bytes += other.sent_bytes
        self.received_bytes += other.received_bytes
        self.seconds += other.seconds


def move_objects(exchange: Any, outgoing: Sequence[Optional[Any]], where: str
                 ) -> Tuple[List[Optional[Any]], MoveCounts]:
    """Send ``outgoing[d]`` to rank d (None: nothing; this rank's own entry is never sent) and receive what every
    rank sent this one: ``incoming[s]`` (None where rank s sent nothing, and at this rank), and the counts. A
    collective of every rank of ``exchange`` (odb.comm.protocol.RankExchange.move).

    Example (two ranks that are threads):
        >>> import threading
        >>> from odb.comm.threads import ThreadRanks
        >>> ranks, got = ThreadRanks(2), [None, None]
        >>> def run(rank):
        ...     ex = ranks.exchanges(rank)(5.0)
        ...     got[rank] = move_objects(ex, [None, ["a"]] if rank == 0 else [None, None], "example")[0]
        >>> threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
        >>> for t in threads: t.start()
        >>> for t in threads: t.join()
        >>> got
        [[None, None], [['a'], None]]
    """
    start = time.perf_counter()
    rank = exchange.rank
    payloads = [b"" if obj is None or d == rank else dumps(obj) for d, obj in enumerate(outgoing)]
    incoming = exchange.move(payloads, where)
    objects = [None if s == rank or not data else pickle.loads(data) for s, data in enumerate(incoming)]
    sent = sum(len(obj) if hasattr(obj, "__len__") else 1 for d, obj in enumerate(outgoing)
               if obj is not None and d != rank)
    counts = MoveCounts(sent, sum(len(p) for p in payloads),
                        sum(len(data) for s, data in enumerate(incoming) if s != rank), time.perf_counter() - start)
    return objects, counts
