"""Ranks as threads of one process: a transport for odb's exchange protocol without torch.distributed.

``ThreadRanks(world_size)`` stands for one "process group" whose ranks are threads.
Each rank's loader gets ``exchange=ranks.exchanges(rank)``: the k-th exchange a rank
makes meets the k-th exchange of every other rank (as every rank of a real run makes its
loaders' exchanges in the same order), and runs the real protocol (status words,
reasons, ``announce``, ``ODBRankFailed``) over a barrier instead of a gloo all_gather.
Used by the tests to run N real ``ODBDataLoader``s in N threads; handy for custom setups.

Example:
    >>> import threading, numpy as np
    >>> ranks = ThreadRanks(2)
    >>> out = [None, None]
    >>> def run(rank):
    ...     ex = ranks.exchanges(rank)(5.0)
    ...     out[rank] = ex.all_gather(np.array([rank * 10]), "example").ravel().tolist()
    >>> threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    >>> for t in threads: t.start()
    >>> for t in threads: t.join()
    >>> out
    [[0, 10], [0, 10]]
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from odb.comm.protocol import ODBExchangeError, RankExchange, exchange_failed
from odb.comm.replicas import Replicas

DEFAULT_TIMEOUT_S = 60.0


class _Meeting:
    """Where the k-th exchange of every rank meets: a barrier and one slot per rank.

    A slot holds the rank's message (an int64 array, for ``gather``) or its outgoing parts (a tuple of
    bytes, for ``exchange_bytes``). The last rank to arrive takes the slots once (the barrier's action,
    before any rank goes on): it stacks messages, or keeps the list of parts; so a collective costs one
    barrier however many ranks meet, and a rank's next message may overwrite its slot at once, since what
    this collective took stays until every rank has arrived at the next."""

    def __init__(self, world_size: int) -> None:
        self.barrier = threading.Barrier(world_size, action=self._take)
        self.slots: List[Any] = [None] * world_size
        self.gathered: Optional[np.ndarray] = None
        self.moved: Optional[List[Tuple[bytes, ...]]] = None
        self.joined = 0  # ranks that took their transport (the meeting is forgotten once all have)

    def _take(self) -> None:
        if all(isinstance(slot, np.ndarray) for slot in self.slots):
            self.gathered, self.moved = np.stack(self.slots), None
        elif all(isinstance(slot, tuple) for slot in self.slots):
            self.gathered, self.moved = None, list(self.slots)
        else:  # ranks out of step (some gather, some move): each raises in its own thread
            self.gathered, self.moved = None, None


class ThreadTransport:
    """One rank's side of a thread meeting: ``gather`` and ``exchange_bytes`` through a barrier (no group to
    own or release)."""

    owns_group = False

    def __init__(self, meeting: _Meeting, rank: int, timeout_s: float) -> None:
        self.meeting, self.rank, self.world_size = meeting, rank, len(meeting.slots)
        self.timeout_s = timeout_s
        self.interrupted: Optional[BaseException] = None

    def gather(self, message: np.ndarray, where: str) -> np.ndarray:
        """(world, len(message)) array of every rank's ``message``; ``ODBExchangeError`` when a rank does
        not arrive within the timeout (the barrier breaks: every waiting rank raises)."""
        self._meet(np.array(message, dtype=np.int64), where)
        gathered = self.meeting.gathered
        if gathered is None:
            raise self._out_of_step(where)
        return gathered.copy()  # each rank owns what it is handed

    def exchange_bytes(self, outgoing: Sequence[bytes], sizes: np.ndarray, where: str) -> List[bytes]:
        """What every rank sent to this one (``outgoing[rank]`` stays here): each rank leaves its parts in
        its slot and, past the barrier, takes its column. ``sizes`` is not needed here (the parts carry
        their lengths); errors as in ``gather``."""
        # bytes() of bytes is the same object; a bytearray is copied, as its sender may change it afterwards
        self._meet(tuple(b"" if d == self.rank else bytes(part) for d, part in enumerate(outgoing)), where)
        moved = self.meeting.moved
        if moved is None:
            raise self._out_of_step(where)
        return [outgoing[s] if s == self.rank else parts[self.rank] for s, parts in enumerate(moved)]

    def _meet(self, slot: Any, where: str) -> None:
        meeting = self.meeting
        try:
            meeting.slots[self.rank] = slot
            meeting.barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError as err:
            meeting.barrier.abort()
            raise exchange_failed(self.rank, self.world_size, where, self.timeout_s, err) from err

    def _out_of_step(self, where: str) -> ODBExchangeError:
        return ODBExchangeError(f"odb rank {self.rank} of {self.world_size}: at {where} some ranks gathered "
                                f"integers while others moved bytes: the ranks' exchanges are out of step. "
                                f"This is a bug in odb (or in a custom exchange's caller); please report it.")

    def release(self) -> None:
        """Nothing to release (a thread meeting holds no group)."""


class ThreadExchanges:
    """One rank's exchange factory (what a loader's ``exchange=`` takes): ``world()`` and, per call, the
    rank's next exchange."""

    def __init__(self, ranks: "ThreadRanks", rank: int) -> None:
        self.ranks, self.rank = ranks, rank
        self.made = 0

    def world(self) -> Tuple[int, int]:
        """(rank, world size): under ``replicas``, this thread's replica and the number of replicas."""
        replicas = self.ranks.replicas
        if replicas is not None:
            return replicas.replica[self.rank], replicas.count
        return self.rank, self.ranks.world_size

    def processes(self) -> int:
        """Threads the exchanges span."""
        return self.ranks.world_size

    def __call__(self, timeout_s: float) -> RankExchange:
        index, self.made = self.made, self.made + 1
        return RankExchange(timeout_s, transport=self.ranks.transport(self.rank, index), replicas=self.ranks.replicas)


class ThreadRanks:
    """``world_size`` ranks that are threads of this process (see the module's docstring).

    ``timeout_s`` bounds every wait at a barrier (a rank that never arrives: every other
    rank raises ``odb.comm.protocol.ODBExchangeError``); the loader's ``exchange_timeout_s`` is
    not used here. ``replicas`` (odb.comm.replicas.Replicas over the ``world_size`` threads) makes the
    threads peers of data-parallel replicas, as a DeviceMesh does for processes.
    """

    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, replicas: Optional[Replicas] = None
                 ) -> None:
        if world_size < 1:
            raise ValueError(f"ThreadRanks got world_size={world_size!r}: a group has at least one rank. "
                             f"Fix: pass world_size >= 1.")
        self.world_size, self.timeout_s = int(world_size), float(timeout_s)
        self.replicas = replicas
        self._meetings: Dict[int, _Meeting] = {}
        self._lock = threading.Lock()

    def exchanges(self, rank: int) -> ThreadExchanges:
        """Rank ``rank``'s exchange factory: pass it as ``odb.ODBDataLoader(..., exchange=...)``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"ThreadRanks.exchanges got rank={rank!r} for {self.world_size} ranks. "
                             f"Fix: pass a rank in 0..{self.world_size - 1}.")
        return ThreadExchanges(self, rank)

    def transport(self, rank: int, index: int = 0) -> ThreadTransport:
        """Rank ``rank``'s side of the ``index``-th meeting."""
        with self._lock:
            meeting = self._meetings.get(index)
            if meeting is None:
                meeting = self._meetings[index] = _Meeting(self.world_size)
            meeting.joined += 1
            if meeting.joined == self.world_size:
                del self._meetings[index]
        return ThreadTransport(meeting, rank, self.timeout_s)

    def abort(self) -> None:
        """Break every meeting: ranks waiting in an exchange raise instead of waiting for a dead thread."""
        with self._lock:
            meetings = list(self._meetings.values())
        for meeting in meetings:
            meeting.barrier.abort()
