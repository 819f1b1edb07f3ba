"""The one module that touches torch.distributed: odb's metadata exchange (protocol and gloo transport).

A CPU (gloo) group of its own for every epoch of every loader, created on the main
thread when the epoch's iterator is built (every rank builds its loaders' iterators in
the same order), carries a few integers per window and per step from the loader's
background thread: a header (groups planned, groups that must be emitted, data ended,
seed, the plan options' fingerprint), per-step summaries (cost, samples, loss tokens)
and a per-step confirmation. A group per epoch means two loaders alive at once never
interleave collectives on one group, and an epoch abandoned while its thread waits in
an exchange cannot disturb the next one. No sample data crosses ranks.

Every message starts with a status word. A rank whose epoch fails (or that stops
iterating) joins its next exchange with ``FAILED`` (or ``STOPPED``) instead of its
data (``RankExchange.announce``); every rank then also gathers a short utf-8 reason,
the announcing ranks re-raise their own error and the others raise ``ODBRankFailed``
naming the rank, so no rank waits for ``exchange_timeout_s``.

The protocol (``RankExchange``) runs over a transport: ``GlooTransport`` here (processes),
``odb.comm.threads.ThreadTransport`` for ranks that are threads of one process (tests).
A loader gets its exchanges from a factory: ``GroupExchanges`` (this module) or
``odb.comm.threads.ThreadRanks.exchanges(rank)``.
"""

from __future__ import annotations

import atexit
import datetime
import threading
from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

OK, FAILED, STOPPED = 0, 1, 2
_UNSET = -1  # what an all_gather part holds until the rank's message arrives
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


def world() -> Tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def new_metadata_group(timeout_s: float) -> Any:
    """A fresh gloo group over all ranks: a collective call (every rank, same order, main thread)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def release_group(group: Any) -> None:
    """Let go of a group made by ``new_metadata_group`` whose exchanges have all finished (local)."""
    try:
        dist.destroy_process_group(group)
    except Exception:  # the default group may already be gone (shutdown); nothing to release then
        pass


# Exchanges whose group odb made and has not released yet, oldest first. A group is released only once
# every rank is known to be done with it (a later collective, e.g. the next epoch's new_group); the last
# ones are released at exit, after a short barrier on each: a gloo group still alive while the interpreter
# finalizes can abort the process ("terminate called without an active exception", pytorch issue 190489).
_LIVE: List["RankExchange"] = []
EXIT_BARRIER_S = 10.0


@atexit.register
def release_at_exit() -> None:
    """Release the groups odb still holds, each after a barrier of every rank at exit (when one does not
    arrive within EXIT_BARRIER_S, e.g. still saving a checkpoint or gone, the group is left as it is)."""
    for ex in list(_LIVE):
        try:
            if not (dist.is_available() and dist.is_initialized()) or ex.dead:
                continue
            ex.transport.exit_barrier(EXIT_BARRIER_S)
        except Exception:  # a rank that is not exiting with us: leave this group (and the rest) alone
            return
        ex.release()


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


def group_world(group: Any = None) -> Tuple[int, int]:
    """(rank, world size) in ``group`` (None: the default group's, or (0, 1) without one); no collective."""
    if group is None:
        return world()
    return dist.get_rank(group), dist.get_world_size(group)


class Transport(Protocol):
    """What ``RankExchange`` runs its protocol over: one rank's side of an all_gather.

    ``gather(message, where)`` returns every rank's ``message`` (int64, the same length on
    every rank) as a (world_size, len) array, or raises ``ODBExchangeError``; ``release()``
    lets go of what the transport holds once its exchanges are over. A transport may also
    have ``owns_group`` and ``group`` (a process group it made), ``interrupted`` (an error to
    raise once a gather that went through is over) and ``exit_barrier(timeout_s)``.
    """

    rank: int
    world_size: int

    def gather(self, message: np.ndarray, where: str) -> np.ndarray: ...

    def release(self) -> None: ...


class ExchangeFactory(Protocol):
    """Where a loader's exchanges come from (the ``exchange=`` of ``odb.ODBDataLoader``):
    ``world()`` is (rank, world size) without a collective; each call makes the rank's next
    exchange (every rank makes its exchanges in the same order). ``GroupExchanges`` below;
    ``odb.comm.threads.ThreadRanks.exchanges(rank)`` for ranks that are threads."""

    def world(self) -> Tuple[int, int]: ...

    def __call__(self, timeout_s: float) -> "RankExchange": ...


class GlooTransport:
    """The transport of processes: all_gather of int64 arrays over a gloo group.

    Without ``group`` it makes a fresh metadata group (a collective call: every rank, same
    order, main thread) and owns it. ``gather`` raises ``ODBExchangeError`` when the group
    fails or times out; an error that a signal handler raised while a gather went through
    is kept in ``interrupted`` for the protocol to raise once the exchange is over.

    Example (one process, no group: nothing to gather with)::

        transport = GlooTransport(60.0)         # under torch.distributed: a gloo group of all ranks
        transport.gather(np.array([0, 7]), "epoch 0")
    """

    def __init__(self, timeout_s: float, group: Any = None) -> None:
        self.owns_group = group is None
        self.rank, self.world_size = group_world(group)
        self.timeout_s = timeout_s
        self.group: Optional[Any] = group
        self.interrupted: Optional[BaseException] = None
        if self.owns_group and self.world_size > 1:
            self.group = new_metadata_group(timeout_s)

    def release(self) -> None:
        """Release the group, if this transport made it (call once its exchanges are over)."""
        if self.owns_group and self.group is not None:
            release_group(self.group)
            self.group = None

    def exit_barrier(self, timeout_s: float) -> None:
        """A barrier of every rank on this group (raises when one does not arrive within ``timeout_s``)."""
        dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s))

    def gather(self, message: np.ndarray, where: str) -> np.ndarray:
        """(world, len(message)) array of every rank's ``message`` (int64, same length on all ranks)."""
        local = torch.as_tensor(message)
        # Every message starts with a status word or a reason's byte (>= 0): a part still holding _UNSET
        # was never received.
        parts = [torch.full_like(local, _UNSET) for _ in range(self.world_size)]
        work = None
        try:
            work = dist.all_gather(parts, local, group=self.group, async_op=True)
            work.wait()
        except Exception as err:  # gloo raises RuntimeError subclasses with the peer's address
            if work is not None and not work.is_completed() and not _finish(work):
                raise exchange_failed(self.rank, self.world_size, where, self.timeout_s, err) from err
            if work is not None and work.is_completed() and _went_through(work, parts, local, self.rank):
                # The exchange went through; the error was raised on this thread by a signal handler that ran
                # once the wait returned (torch raises a DataLoader worker's death so). Every rank has this
                # message: all_gather raises the error once its exchange is over, so the ranks stay in step
                # and this rank can still announce the error at the next exchange.
                self.interrupted = self.interrupted or err
                return torch.stack(parts).numpy()
            raise exchange_failed(self.rank, self.world_size, where, self.timeout_s, err) from err
        return torch.stack(parts).numpy()


def _finish(work: Any, attempts: int = 3) -> bool:
    """Wait again for a collective whose wait was left by an error that is not its own (a signal
    handler's: torch raises a DataLoader worker's death on the main thread, maybe while it waits here).
    The collective was posted: the peers complete it with this rank, so this rank must see it through
    or it drops out of the exchange they finished together. False when the collective itself fails."""
    for _ in range(attempts):
        try:
            work.wait()
            return True
        except Exception:  # noqa: BLE001 - its own failure (then completed) or one more signal's error
            if work.is_completed():
                return False
    return False


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
    """odb's exchange protocol: all_gather of small int64 arrays with a status word and a clear error.

    The protocol (status word, reasons, ``dead``, ``announce``, ``ODBRankFailed`` on the peers)
    runs over a transport: by default a gloo group (``GlooTransport(timeout_s, group)``); tests
    and custom setups pass ``transport=`` (e.g. ``odb.comm.threads.ThreadRanks``, ranks as
    threads). Once an exchange has seen a failure (its own announcement, another rank's, or
    an error of the transport itself) it is ``dead``: no rank exchanges on it again.

    Example:
        >>> from odb.comm.threads import ThreadRanks
        >>> ex = RankExchange(5.0, transport=ThreadRanks(1).transport(0))
        >>> ex.all_gather(np.array([3, 4]), "example").tolist()
        [[3, 4]]
    """

    def __init__(self, timeout_s: float, group: Any = None, *, transport: Optional[Transport] = None) -> None:
        self.transport: Any = transport if transport is not None else GlooTransport(timeout_s, group)
        self.rank, self.world_size = self.transport.rank, self.transport.world_size
        self.timeout_s = timeout_s
        self.dead = False
        self._announced = False
        self._announcing = threading.Lock()  # the training thread and the batch thread may both announce
        if getattr(self.transport, "owns_group", False) and self.world_size > 1:
            _LIVE.append(self)

    @property
    def group(self) -> Any:
        """The transport's process group (None for transports without one)."""
        return getattr(self.transport, "group", None)

    def release(self) -> None:
        """Release the transport's group, if it made one (call once the exchanges are over)."""
        if getattr(self.transport, "owns_group", False) and self.transport.group is not None:
            self.transport.release()
            self.dead = True  # a released exchange takes no more collectives (None would mean the default group)
            if self in _LIVE:
                _LIVE.remove(self)

    def all_gather(self, values: np.ndarray, where: str, status: int = OK, reason: str = ""
                   ) -> Optional[np.ndarray]:
        """(world, *values.shape) array of every rank's values (same shape on all ranks).

        Raises ``ODBRankFailed`` when another rank announced a failure or a stop at this
        exchange; returns None on a rank that announced one itself (``status`` not OK).
        """
        values = np.ascontiguousarray(values, dtype=np.int64)
        if self.dead:
            raise ODBExchangeError(f"odb rank {self.rank} of {self.world_size}: the metadata exchange at {where} "
                                   f"was used after it failed. This is a bug in odb; please report it.")
        message = np.concatenate(([status], values.reshape(-1)))
        gathered = self._gather(message, where)
        statuses = gathered[:, 0]
        if not statuses.any():
            self._raise_interrupted()
            return gathered[:, 1:].reshape((self.world_size,) + values.shape)
        self.dead = True
        slots = self._gather(encode_reason(reason if status != OK else ""), where)
        self._raise_interrupted()
        if status != OK:
            return None
        raise peer_error(self.rank, self.world_size, where, statuses.tolist(), [decode_reason(s) for s in slots])

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
            if self.dead or self.world_size <= 1 or self._announced:
                return
            self._announced = True
        status, reason = failure_of(error)
        self.all_gather(np.zeros(shape, dtype=np.int64), where, status, reason)


class GroupExchanges:
    """Makes the exchanges of an odb loader over torch.distributed: on ``group``, or (None) each on a
    fresh gloo group of the default group's ranks. ``world()`` says (rank, world size) without a
    collective; calling it makes one exchange (a collective where it makes a group).

    Example:
        >>> GroupExchanges().world()   # no torch.distributed here: one rank
        (0, 1)
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def world(self) -> Tuple[int, int]:
        """(rank, world size) of the ranks this factory's exchanges span."""
        return group_world(self.group)

    def __call__(self, timeout_s: float) -> RankExchange:
        return RankExchange(timeout_s, self.group)


def _went_through(work: Any, parts: List[torch.Tensor], local: torch.Tensor, rank: int) -> bool:
    """Whether a completed collective holds no error. torch before 2.7 cannot hand a stored error to Python
    (``Work.exception()`` raises TypeError on its exception_ptr): there, the collective went through when
    every rank's part arrived (none still holds _UNSET) and this rank's is its own message."""
    try:
        return work.exception() is None
    except TypeError:
        return all(int(p[0]) != _UNSET for p in parts) and torch.equal(parts[rank], local)


def announce_in_background(exchange: Any, shape: Tuple[int, ...], where: str, error: Optional[BaseException],
                           cause: Optional[Callable[[Optional[BaseException]], Optional[BaseException]]] = None
                           ) -> Optional[threading.Thread]:
    """``exchange.announce`` on a daemon thread, so the announcing rank raises its own error at once
    (the others may reach that exchange only later). None when there is nothing to announce.
    ``cause(error)``, when given and not None, is announced instead (asked on that thread: it may wait)."""
    if exchange is None or getattr(exchange, "dead", True) or exchange.world_size <= 1:
        return None

    def run() -> None:
        try:
            exchange.announce(shape, where, (cause(error) if cause is not None else None) or error)
        except Exception:  # best effort: the group may be broken too (a dead peer); this rank raises anyway
            pass

    thread = threading.Thread(target=run, name="odb-announce", daemon=True)
    thread.start()
    return thread
