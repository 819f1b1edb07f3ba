"""odb's exchange protocol between ranks, apart from any transport (numpy only, no torch.distributed).

A loader's background thread exchanges a few integers per window and per step with the
other ranks: a header (groups planned, groups that must be emitted, data ended, seed, the
plan options' fingerprint), per-step summaries (cost, samples, loss tokens) and a per-step
confirmation. ``RankExchange.move`` also moves bytes between ranks (samples of a global
step plan): an all_gather of the sizes, then the bytes themselves.

Every message starts with a status word. A rank whose epoch fails (or that stops
iterating) joins its next exchange with ``FAILED`` (or ``STOPPED``) instead of its
data (``RankExchange.announce``); every rank then also gathers a short utf-8 reason,
the announcing ranks re-raise their own error and the others raise ``ODBRankFailed``
naming the rank, so no rank waits for ``exchange_timeout_s``.

``RankExchange`` runs this protocol over a ``Transport``: ``odb.comm.dist.GlooTransport``
(processes, the one module that touches torch.distributed) or
``odb.comm.threads.ThreadTransport`` (ranks that are threads of one process, in tests).
A loader gets its exchanges from an ``ExchangeFactory``: ``odb.comm.dist.GroupExchanges``
or ``odb.comm.threads.ThreadRanks.exchanges(rank)``.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import numpy as np

from odb.comm.replicas import Replicas

OK, FAILED, STOPPED = 0, 1, 2
REASON_BYTES = 1024  # utf-8 bytes of a failure reason carried to the other ranks (longer ones are cut)


class ODBExchangeError(RuntimeError):
    """A rank did not take part in odb's metadata exchange (it died, stalled or diverged)."""


class ODBRankFailed(ODBExchangeError):
    """Another rank's odb loader failed or stopped iterating: this rank stops too.

    ``rank`` is the first rank that failed (else the first that stopped), ``reason`` its own words.
    """

    def __init__(self, message: str, rank: int, reason: str) -> None:
        super().__init__(message)
        self.rank, self.reason = rank, reason


class ODBOptionMismatch(ODBExchangeError):
    """The ranks' loaders were built with different options that change the plan."""


class ODBPeerMismatch(ODBExchangeError):
    """Two peers of one data-parallel replica (its TP, CP, SP or PP ranks) sent different plan messages: their
    batches would differ (odb.comm.replicas)."""


def encode_reason(text: str) -> np.ndarray:
    """``text`` as utf-8 in a fixed-size int64 slot; a longer text keeps its start and its end (a
    worker's error ends with the original message) around " [...] ".

    Example:
        >>> decode_reason(encode_reason("ValueError: too long"))
        'ValueError: too long'
        >>> len(decode_reason(encode_reason("x" * 5000))) <= REASON_BYTES
        True
    """
    raw = text.encode("utf-8")
    if len(raw) > REASON_BYTES:
        head, tail = REASON_BYTES // 3, REASON_BYTES - REASON_BYTES // 3 - 7
        raw = (raw[:head].decode("utf-8", "ignore") + " [...] " + raw[-tail:].decode("utf-8", "ignore")).encode()
    slot = np.zeros(REASON_BYTES // 8, dtype=np.int64)
    slot.view(np.uint8)[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    return slot


def decode_reason(slot: np.ndarray) -> str:
    """The text of ``encode_reason``."""
    return np.ascontiguousarray(slot, dtype=np.int64).tobytes().rstrip(b"\0").decode("utf-8", "replace")


def failure_of(error: Optional[BaseException]) -> Tuple[int, str]:
    """(status, reason) a rank announces for ``error`` (None: it stopped iterating, no error).

    Example:
        >>> failure_of(ValueError("bad sample"))
        (1, 'ValueError: bad sample')
    """
    if error is None:
        return STOPPED, "it stopped iterating its odb loader before the epoch ended (a break, or an error outside odb)"
    text = str(error).strip() or "(no message)"
    return FAILED, f"{type(error).__name__}: {text}"


def peer_error(rank: int, world_size: int, where: str, statuses: Sequence[int], reasons: List[str]
               ) -> ODBRankFailed:
    """The error of a rank that saw other ranks announce a failure (or a stop) at ``where``.

    Example:
        >>> str(peer_error(0, 2, "epoch 0, step 3", [0, 1], ["", "ValueError: bad"]))[:60]
        'odb rank 0 of 2: rank 1 failed at epoch 0, step 3 (ValueErro'
    """
    failed = [r for r, s in enumerate(statuses) if s == FAILED]
    stopped = [r for r, s in enumerate(statuses) if s == STOPPED]
    first = (failed or stopped)[0]
    if failed:
        what = f"rank {first} failed at {where} ({reasons[first]})"
        fix = f"fix the cause in rank {first}'s error (its log), then restart every rank"
    else:
        what = f"rank {first} stopped iterating its odb loader at {where} while this rank still iterates it"
        fix = (f"every rank must iterate its odb loaders to the same step; if rank {first} raised an error outside "
               f"odb, see its log")
    others = [r for r in failed + stopped if r != first]
    also = f"; also rank(s) {others}" if others else ""
    return ODBRankFailed(f"odb rank {rank} of {world_size}: {what}{also}; this rank stops too. Fix: {fix}.",
                         first, reasons[first])


class Transport(Protocol):
    """What ``RankExchange`` runs its protocol over: one rank's side of an all_gather and of an all-to-all.

    ``gather(message, where)`` returns every rank's ``message`` (int64, the same length on
    every rank) as a (world_size, len) array, or raises ``ODBExchangeError``;
    ``exchange_bytes(outgoing, sizes, where)`` sends ``outgoing[d]`` to every other rank d and
    returns what each rank s sent to this one (``incoming[s]``; ``incoming[rank]`` is
    ``outgoing[rank]``, never sent), where ``sizes[s][d]`` (every rank holds the same matrix,
    gathered first) is the length of what s sends to d; when no size off the diagonal is
    above 0 it runs no collective (every rank sees so alike). ``release()`` lets go of what
    the transport holds once its exchanges are over. A transport may also have
    ``owns_group`` and ``group`` (a process group it made), ``interrupted`` (an error to
    raise once a collective that went through is over) and ``exit_barrier(timeout_s)``.
    """

    rank: int
    world_size: int

    def gather(self, message: np.ndarray, where: str) -> np.ndarray: ...

    def exchange_bytes(self, outgoing: Sequence[bytes], sizes: np.ndarray, where: str) -> List[bytes]: ...

    def release(self) -> None: ...


class ExchangeFactory(Protocol):
    """Where a loader's exchanges come from (the ``exchange=`` of ``odb.ODBDataLoader``):
    ``world()`` is (rank, world size) without a collective (under a mesh: the data-parallel replica and the
    number of replicas), ``processes()`` how many processes the exchanges span (more than the world size
    where each replica has several peers); each call makes the rank's next exchange (every rank makes its
    exchanges in the same order). ``GroupExchanges`` below;
    ``odb.comm.threads.ThreadRanks.exchanges(rank)`` for ranks that are threads."""

    def world(self) -> Tuple[int, int]: ...

    def processes(self) -> int: ...

    def __call__(self, timeout_s: float) -> "RankExchange": ...


def move_header_shape(world_size: int) -> Tuple[int]:
    """The shape of the values a rank gathers first in ``RankExchange.move``: its outgoing sizes, one per
    rank. A rank that fails just before a move announces with it, ``exchange.announce(move_header_shape(W),
    where, error)``, so it meets the others at their size gather.

    Example:
        >>> move_header_shape(4)
        (4,)
    """
    return (int(world_size),)


def outgoing_sizes(outgoing: Sequence[Any], rank: int, world_size: int) -> np.ndarray:
    """The int64 sizes of ``outgoing`` (one part per rank) as the other ranks must see them: this rank's own
    part never crosses, so its size is 0. Raises naming the part that is not bytes, or the count.

    Example:
        >>> outgoing_sizes([b"ab", b"", b"xyz"], rank=0, world_size=3).tolist()
        [0, 0, 3]
    """
    if len(outgoing) != world_size:
        raise ValueError(f"odb rank {rank} of {world_size}: move got {len(outgoing)} outgoing parts; it takes "
                         f"one per rank (outgoing[d] goes to rank d). Fix: pass a list of {world_size} bytes, "
                         f"b'' for a rank that gets nothing.")
    for d, part in enumerate(outgoing):
        if not isinstance(part, (bytes, bytearray)):
            raise TypeError(f"odb rank {rank} of {world_size}: move got outgoing[{d}] of type "
                            f"{type(part).__name__}; the parts are bytes. Fix: serialize it first "
                            f"(e.g. pickle.dumps) and pass bytes, b'' for nothing.")
    sizes = np.array([len(part) for part in outgoing], dtype=np.int64)
    sizes[rank] = 0
    return sizes


def peer_mismatch(rank: int, world_size: int, where: str, process: int, leader: int) -> ODBPeerMismatch:
    """The error of every process that saw two peers of one replica send different plan messages at ``where``.

    Example:
        >>> str(peer_mismatch(0, 4, "epoch 0, window 2", 3, 2))[:72]
        'odb rank 0 of 4: at epoch 0, window 2 rank 3 sent another plan message t'
    """
    return ODBPeerMismatch(
        f"odb rank {rank} of {world_size}: at {where} rank {process} sent another plan message than rank {leader}, "
        f"the first peer of its data-parallel replica (other samples, step figures or, with check_peers, another "
        f"batch), so their batches would differ. Rule: the peers of a replica "
        f"(its tensor, context, sequence or pipeline parallel ranks) plan from the same inputs: the same sampler "
        f"shard (num_replicas and rank of the data-parallel dimension), the same dataset and processing, the same "
        f"odb options and seed. Fix: build rank {process}'s loader as rank {leader}'s (e.g. DistributedSampler("
        f"num_replicas=mesh['dp'].size(), rank=mesh['dp'].get_local_rank()) on every rank).")


def exchange_failed(rank: int, world_size: int, where: str, timeout_s: float, err: BaseException
                    ) -> ODBExchangeError:
    """The error of a rank whose transport failed at ``where`` (a peer died, stalled or stopped)."""
    return ODBExchangeError(
        f"odb rank {rank} of {world_size}: the metadata exchange at {where} failed or waited "
        f"more than exchange_timeout_s={timeout_s}: another rank died, stalled or stopped iterating "
        f"its odb loader ({type(err).__name__}: {err}). Fix: check the other ranks' logs; every rank "
        f"must iterate its odb loaders in the same order; raise exchange_timeout_s for very slow "
        f"steps.")


class RankExchange:
    """odb's exchange protocol: all_gather of small int64 arrays with a status word and a clear error, and
    ``move`` of bytes between ranks behind such a gather.

    The protocol (status word, reasons, ``dead``, ``announce``, ``ODBRankFailed`` on the peers)
    runs over ``transport``: a gloo group (``odb.comm.dist.GlooTransport``, made by
    ``odb.comm.dist.GroupExchanges``) or ranks that are threads (``odb.comm.threads.ThreadRanks``).
    Once an exchange has seen a failure (its own announcement, another rank's, or an error of
    the transport itself) it is ``dead``: no rank exchanges on it again.

    Example:
        >>> from odb.comm.threads import ThreadRanks
        >>> ex = RankExchange(5.0, transport=ThreadRanks(1).transport(0))
        >>> ex.all_gather(np.array([3, 4]), "example").tolist()
        [[3, 4]]
    """

    def __init__(self, timeout_s: float, *, transport: Transport, replicas: Optional[Replicas] = None) -> None:
        self.transport: Any = transport
        # the processes the transport spans; rank and world size are the data-parallel replicas' (the same where
        # every replica is one process)
        self.process_rank, self.processes = self.transport.rank, self.transport.world_size
        if replicas is not None and replicas.processes != self.processes:
            raise ValueError(f"odb: a layout of {replicas.processes} processes for an exchange over "
                             f"{self.processes}. Fix: give one (replica, peer) per process of the exchange.")
        self.replicas = replicas
        if replicas is not None:
            self.rank, self.world_size = replicas.replica[self.process_rank], replicas.count
        else:
            self.rank, self.world_size = self.process_rank, self.processes
        self.timeout_s = timeout_s
        self.dead = False
        self._announced = False
        self._announcing = threading.Lock()  # the training thread and the batch thread may both announce

    @property
    def group(self) -> Any:
        """The transport's process group (None for transports without one)."""
        return getattr(self.transport, "group", None)

    def release(self) -> None:
        """Release the transport's group, if it made one (call once the exchanges are over)."""
        if getattr(self.transport, "owns_group", False) and self.transport.group is not None:
            self.transport.release()
            self.dead = True  # a released exchange takes no more collectives (None would mean the default group)

    def all_gather(self, values: np.ndarray, where: str, status: int = OK, reason: str = "", *,
                   every_process: bool = False) -> Optional[np.ndarray]:
        """(world, *values.shape) array of every rank's values (same shape on all ranks): one row per
        data-parallel replica (its first peer's, checked against its other peers': ``replica_rows``), or with
        ``every_process`` one per process (what each process measured: the caller agrees on it).

        Raises ``ODBRankFailed`` when another process announced a failure or a stop at this
        exchange; returns None on a process that announced one itself (``status`` not OK).
        """
        values = np.ascontiguousarray(values, dtype=np.int64)
        self._check_alive(where)
        message = np.concatenate(([status], values.reshape(-1)))
        gathered = self._gather(message, where)
        statuses = gathered[:, 0]
        if not statuses.any():
            self._raise_interrupted()
            rows = gathered[:, 1:].reshape((self.processes,) + values.shape)
            return rows if every_process else self.replica_rows(rows, where)
        self.dead = True
        slots = self._gather(encode_reason(reason if status != OK else ""), where)
        self._raise_interrupted()
        if status != OK:
            return None
        raise peer_error(self.process_rank, self.processes, where, statuses.tolist(),
                         [decode_reason(s) for s in slots])

    def replica_rows(self, rows: np.ndarray, where: str, compare: Optional[Callable[[np.ndarray], np.ndarray]] = None
                     ) -> np.ndarray:
        """One row per replica of ``rows`` (one per process): its leader's, after checking that every peer sent
        the same (``compare(rows)``: the part that must be equal; default all of it). Peers that differ would get
        different batches: every process raises ``ODBPeerMismatch`` (each sees the same rows).

        Example (no replicas: every process is a replica of its own):
            >>> from odb.comm.threads import ThreadRanks
            >>> RankExchange(5.0, transport=ThreadRanks(1).transport(0)).replica_rows(np.array([[4]]), "x").tolist()
            [[4]]
        """
        if self.replicas is None:
            return rows
        found = self.replicas.mismatch(rows if compare is None else compare(rows))
        if found is not None:
            self.dead = True
            raise peer_mismatch(self.process_rank, self.processes, where, *found)
        return self.replicas.rows(rows)

    def all_agree(self, flag: bool, where: str) -> bool:
        """Whether ``flag`` holds on every rank (one gather; every rank calls it at the same point).

        Example:
            >>> from odb.comm.threads import ThreadRanks
            >>> RankExchange(5.0, transport=ThreadRanks(1).transport(0)).all_agree(True, "example")
            True
        """
        gathered = self.all_gather(np.array([int(bool(flag))]), where)
        return bool(gathered is not None and gathered.all())

    def move(self, outgoing: Sequence[bytes], where: str) -> List[bytes]:
        """Move bytes between ranks: ``outgoing[d]`` goes to rank d; returns ``incoming``, where
        ``incoming[s]`` is what rank s sent to this rank (``incoming[rank]`` is ``outgoing[rank]`` itself,
        never sent). Every rank moves at the same exchange, with one part (maybe b"") per rank.

        First an ``all_gather`` of this rank's outgoing sizes (shape ``move_header_shape(world_size)``, the
        shape to announce a failure with), so a rank that announced makes every other rank raise
        ``ODBRankFailed`` before any byte moves; then ``transport.exchange_bytes`` (no collective at all
        when nothing crosses). One rank alone moves nothing and runs no collective.

        Example (two ranks that are threads; each sends "from->to"):
            >>> import threading
            >>> from odb.comm.threads import ThreadRanks
            >>> ranks = ThreadRanks(2)
            >>> got = [None, None]
            >>> def run(rank):
            ...     ex = ranks.exchanges(rank)(5.0)
            ...     got[rank] = ex.move([f"{rank}->{d}".encode() for d in range(2)], "example")
            >>> threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
            >>> for t in threads: t.start()
            >>> for t in threads: t.join()
            >>> got
            [[b'0->0', b'1->0'], [b'0->1', b'1->1']]
        """
        sizes = outgoing_sizes(outgoing, self.rank, self.world_size)
        if self.world_size == 1:
            self._check_alive(where)
            return [outgoing[0]]
        # raises ODBRankFailed when a process announced here; peers' sizes may differ (pickles of equal samples)
        matrix = self.all_gather(sizes, where, every_process=True)
        if matrix is None:  # only a rank that announces gets None, and this one sends OK
            raise RuntimeError(f"odb rank {self.rank}: the size exchange of move at {where} returned nothing. This is "
                               f"a bug in odb; please report it.")
        replicas, parts = self.replicas, outgoing
        if replicas is not None:  # peer k of each replica sends to peer k of the others
            matrix, parts = replicas.process_sizes(matrix), replicas.process_parts(outgoing, self.process_rank)
        try:
            incoming = self.transport.exchange_bytes(parts, matrix, where)
        except ODBExchangeError:
            self.dead = True
            raise
        self._raise_interrupted()
        if replicas is not None:
            return replicas.replica_parts(incoming, self.process_rank, outgoing[self.rank])
        return incoming

    def _check_alive(self, where: str) -> None:
        if self.dead:
            raise ODBExchangeError(f"odb rank {self.rank} of {self.world_size}: the metadata exchange at {where} "
                                   f"was used after it failed. This is a bug in odb; please report it.")

    def _gather(self, message: np.ndarray, where: str) -> np.ndarray:
        try:
            return self.transport.gather(message, where)
        except ODBExchangeError:
            self.dead = True
            raise

    def _raise_interrupted(self) -> None:
        err = getattr(self.transport, "interrupted", None)
        if err is not None:
            self.transport.interrupted = None
            raise err

    def announce(self, shape: Tuple[int, ...], where: str, error: Optional[BaseException]) -> None:
        """Join the next exchange (whose values have ``shape`` on every rank) with a failure
        (``error``) or a stop (None) instead of data, so the other ranks raise at once.

        Blocks until every rank reached that exchange; does nothing on a dead exchange, or after the
        first announcement (two would be two collectives of one rank).
        """
        with self._announcing:
            if self.dead or self.processes <= 1 or self._announced:
                return
            self._announced = True
        status, reason = failure_of(error)
        self.all_gather(np.zeros(shape, dtype=np.int64), where, status, reason)


class Announcer(Protocol):
    """What owes the other ranks an announcement: ``announcement_settled()`` is False while one is due and not
    yet made (a failure that odb's batch thread will announce at its next exchange, say)."""

    def announcement_settled(self) -> bool: ...


# Announcements that may still be due. A process that exits right after its loader failed must not take the
# news with it: odb.comm.dist waits for these at exit (wait_for_announcements) before letting go of its groups.
_DUE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def owe_announcements(announcer: Announcer) -> None:
    """Keep ``announcer`` among those ``wait_for_announcements`` waits for (held weakly)."""
    _DUE.add(announcer)


def wait_for_announcements(timeout_s: float) -> bool:
    """Wait until every announcement that is due has been made (True), or ``timeout_s`` passed (False).

    Example:
        >>> wait_for_announcements(0.1)
        True
    """
    deadline = time.monotonic() + timeout_s
    while any(not a.announcement_settled() for a in list(_DUE)):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


class _AnnounceThread(threading.Thread):
    def announcement_settled(self) -> bool:
        return not self.is_alive()


def announce_in_background(exchange: Any, shape: Tuple[int, ...], where: str, error: Optional[BaseException],
                           cause: Optional[Callable[[Optional[BaseException]], Optional[BaseException]]] = None
                           ) -> Optional[threading.Thread]:
    """``exchange.announce`` on a daemon thread, so the announcing rank raises its own error at once
    (the others may reach that exchange only later). None when there is nothing to announce.
    ``cause(error)``, when given and not None, is announced instead (asked on that thread: it may wait)."""
    if exchange is None or getattr(exchange, "dead", True) or exchange.processes <= 1:
        return None

    def run() -> None:
        try:
            exchange.announce(shape, where, (cause(error) if cause is not None else None) or error)
        except Exception:  # best effort: the group may be broken too (a dead peer); this rank raises anyway
            pass

    thread = _AnnounceThread(target=run, name="odb-announce", daemon=True)
    owe_announcements(thread)
    thread.start()
    return thread
