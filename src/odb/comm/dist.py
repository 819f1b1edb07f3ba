"""The one module that touches torch.distributed: the gloo transport of odb's exchange and its groups.

A CPU (gloo) group of its own for every epoch of every loader, created on the main
thread when the epoch's iterator is built (every rank builds its loaders' iterators in
the same order), carries the exchange protocol's messages (odb.comm.protocol) from the
loader's background thread. A group per epoch means two loaders alive at once never
interleave collectives on one group, and an epoch abandoned while its thread waits in
an exchange cannot disturb the next one. ``GroupExchanges`` makes a loader's exchanges
(``RankExchange`` over a ``GlooTransport``); ``world()`` reads the default group.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import signal
import threading
from typing import Any, Callable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from odb.comm.protocol import RankExchange, exchange_failed, wait_for_announcements
from odb.comm.replicas import Replicas, mesh_layout

_UNSET = -1  # what an all_gather part holds until the rank's message arrives


def world() -> Tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def new_metadata_group(timeout_s: float, ranks: Optional[Sequence[int]] = None) -> Any:
    """A fresh gloo group over all ranks (``ranks`` None), or over ``ranks`` (global ranks, a strict subset of the
    default group's): a collective call of every rank of the new group, in the same order, on the main thread.
    Over a subset, only its ranks make the call (torch's ``use_local_synchronization``)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if ranks is None:
        return dist.new_group(backend="gloo", timeout=timeout)
    return dist.new_group(ranks=list(ranks), backend="gloo", timeout=timeout, use_local_synchronization=True)


def group_ranks(group: Any) -> Optional[List[int]]:
    """The global ranks of ``group`` in its rank order, or None where they are every rank of the default group
    in order (a fresh group over them is made as one over all ranks); no collective.

    A group of the user's is not where odb's exchanges run: one loader exchanges on two threads at once (known
    lengths: the batch thread plans while the training thread exchanges each step's supervised tokens) and an
    epoch abandoned inside an exchange must not disturb the next, so each exchange gets a fresh group over the
    user's group's ranks, as it gets one over all ranks without a group. (Two exchanges on the user's group
    interleaved their collectives and gloo aborted the process: "Received data size doesn't match expected
    size".)"""
    ranks = [int(r) for r in dist.get_process_group_ranks(group)]
    return None if ranks == list(range(dist.get_world_size())) else ranks


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
_LIVE: List[RankExchange] = []
EXIT_BARRIER_S = 10.0
# Groups over a strict subset of the ranks whose exchanges every rank released, kept for the next exchange over
# those ranks (``SpareGroups``); destroyed at exit.
_SPARE: List[List[Any]] = []


@atexit.register
def release_at_exit() -> None:
    """Release the groups odb still holds, each after a barrier of every rank at exit (when one does not
    arrive within EXIT_BARRIER_S, e.g. still saving a checkpoint or gone, the group is left as it is).
    First, a failure this process has yet to announce is announced (within EXIT_BARRIER_S): a rank that
    exits right after its loader failed still tells the others why."""
    if _LIVE:
        wait_for_announcements(EXIT_BARRIER_S)
    for ex in list(_LIVE):
        try:
            if not (dist.is_available() and dist.is_initialized()) or ex.dead:
                continue
            ex.transport.exit_barrier(EXIT_BARRIER_S)
        except Exception:  # a rank that is not exiting with us: leave this group (and the rest) alone
            return
        ex.release()
    for spare in _SPARE:  # no collective runs on these: nobody waits for them
        while spare:
            release_group(spare.pop())


def live_exchange(timeout_s: float, ranks: Optional[List[int]] = None, spare: Optional[List[Any]] = None,
                  replicas: Optional[Replicas] = None) -> RankExchange:
    """A ``RankExchange`` over a ``GlooTransport`` on a fresh gloo group (a collective call) over ``ranks``
    (global ranks; None: all ranks), kept for ``release_at_exit`` until it is released. ``spare``: where groups
    over a strict subset of the ranks go when released, and come from (``GlooTransport``); ``replicas``: the
    processes' data-parallel replicas (odb.comm.replicas)."""
    return kept_live(RankExchange(timeout_s, transport=GlooTransport(timeout_s, ranks, spare), replicas=replicas))


def kept_live(ex: RankExchange) -> RankExchange:
    """``ex``, kept for ``release_at_exit`` while it holds a group of its own."""
    if ex.transport.owns_group and ex.processes > 1:
        _LIVE.append(ex)
    return ex


def group_world(group: Any = None) -> Tuple[int, int]:
    """(rank, world size) in ``group`` (None: the default group's, or (0, 1) without one); no collective."""
    if group is None:
        return world()
    return dist.get_rank(group), dist.get_world_size(group)


def ranks_world(ranks: Optional[Sequence[int]]) -> Tuple[int, int]:
    """(this process's index in ``ranks``, len(ranks)); None: the default group's (rank, world size)."""
    if ranks is None:
        return world()
    me = dist.get_rank()
    if me not in ranks:
        raise ValueError(f"odb rank {me}: an exchange over ranks {list(ranks)} was made on a rank outside them. "
                         f"Fix: build the loader only on the ranks of its group or mesh.")
    return list(ranks).index(me), len(ranks)


class GlooTransport:
    """The transport of processes: all_gather of int64 arrays and all-to-all of bytes over a gloo group.

    It makes a fresh metadata group over ``ranks`` (global ranks in rank order; None: all ranks; a collective
    call: every rank of it, same order, main thread) and owns it (``group_ranks`` says why never a group of the
    user's). ``gather`` and ``exchange_bytes`` raise ``ODBExchangeError``
    when the group fails or times out; an error that a signal handler raised while a collective
    went through is kept in ``interrupted`` for the protocol to raise once the exchange is over.

    Example (one process, no group: nothing to gather with)::

        transport = GlooTransport(60.0)         # under torch.distributed: a gloo group of all ranks
        transport.gather(np.array([0, 7]), "epoch 0")
    """

    def __init__(self, timeout_s: float, ranks: Optional[List[int]] = None, spare: Optional[List[Any]] = None
                 ) -> None:
        self.owns_group = True
        self.rank, self.world_size = ranks_world(ranks)
        self.timeout_s = timeout_s
        self.group: Optional[Any] = None
        self.interrupted: Optional[BaseException] = None
        # Over a strict subset of the ranks torch names a new group by its ranks and the number of groups alive
        # in the process: one made after a release can take the name of one still alive ("The specified group
        # name has already been created"). So such a group, once released, goes to ``spare`` (every rank
        # releases alike: ``agrees_releases``) and the next exchange takes it instead of a new one.
        self.spare = (spare if spare is not None else []) if ranks is not None else None
        self.agrees_releases = self.spare is not None
        if self.world_size > 1:
            self.group = self.spare.pop(0) if self.spare else new_metadata_group(timeout_s, ranks)

    def release(self) -> None:
        """Release the group, if this transport made it (call once its exchanges are over)."""
        if self.owns_group and self.group is not None:
            if self.spare is not None:
                self.spare.append(self.group)  # (its collectives are over on every rank: the next one reuses it)
                if not any(kept is self.spare for kept in _SPARE):
                    _SPARE.append(self.spare)  # (destroyed at exit)
            else:
                release_group(self.group)
            self.group = None
            _LIVE[:] = [ex for ex in _LIVE if ex.transport is not self]

    def exit_barrier(self, timeout_s: float) -> None:
        """A barrier of every rank on this group (raises when one does not arrive within ``timeout_s``)."""
        dist.monitored_barrier(group=self.group, timeout=datetime.timedelta(seconds=timeout_s))

    def gather(self, message: np.ndarray, where: str) -> np.ndarray:
        """(world, len(message)) array of every rank's ``message`` (int64, same length on all ranks)."""
        local = torch.as_tensor(message)
        # Every message starts with a status word or a reason's byte (>= 0): a part still holding _UNSET
        # was never received.
        parts = [torch.full_like(local, _UNSET) for _ in range(self.world_size)]

        self._see_through(lambda: dist.all_gather(parts, local, group=self.group, async_op=True), where,
                          lambda work: _went_through(work, parts, local, self.rank))
        return torch.stack(parts).numpy()

    def exchange_bytes(self, outgoing: Sequence[bytes], sizes: np.ndarray, where: str) -> List[bytes]:
        """What every rank sent to this one (``outgoing[rank]`` stays here): one ``all_to_all_single`` of
        uint8 CPU tensors split by ``sizes`` (sizes[s][d]: bytes s sends to d, the same matrix on every
        rank); none when nothing crosses.

        Example (under torch.distributed, 2 ranks, each sending 3 bytes to the other)::

            transport.exchange_bytes([b"", b"abc"], np.array([[0, 3], [3, 0]]), "step 4")   # on rank 0
        """
        send, recv = _splits(sizes, self.rank)
        incoming: List[bytes] = [b""] * self.world_size
        incoming[self.rank] = outgoing[self.rank]
        if _nothing_crosses(sizes):  # every rank holds the same sizes: all of them skip the collective
            return incoming
        source = _send_buffer(outgoing, send, self.rank)
        target = torch.empty(sum(recv), dtype=torch.uint8)
        self._see_through(lambda: dist.all_to_all_single(target, source, recv, send, group=self.group,
                                                         async_op=True), where, _bytes_went_through)
        received, start = target.numpy(), 0
        for s, n in enumerate(recv):
            if s != self.rank:
                incoming[s] = received[start:start + n].tobytes()
            start += n
        return incoming

    def _see_through(self, post: Callable[[], Any], where: str, went_through: Callable[[Any], bool]) -> None:
        """Post a collective (``post()`` returns its work handle) and wait until it is over, or raise
        ``exchange_failed`` naming this rank and ``where``. ``went_through(work)`` tells whether a completed
        collective that left its wait with an error holds none of its own (the error was a signal handler's)."""
        work = None
        try:
            with _worker_deaths_held():  # posted and held by this rank, or neither
                work = post()
            work.wait()
        except Exception as err:  # gloo raises RuntimeError subclasses with the peer's address
            if work is not None and not work.is_completed() and not _finish(work):
                raise exchange_failed(self.rank, self.world_size, where, self.timeout_s, err) from err
            if work is not None and work.is_completed() and went_through(work):
                # The exchange went through; the error was raised on this thread by a signal handler that ran
                # once the wait returned (torch raises a DataLoader worker's death so). Every rank has this
                # message: the exchange raises the error once it is over, so the ranks stay in step and this
                # rank can still announce the error at the next exchange.
                self.interrupted = self.interrupted or err
                return
            raise exchange_failed(self.rank, self.world_size, where, self.timeout_s, err) from err


def _splits(sizes: np.ndarray, rank: int) -> Tuple[List[int], List[int]]:
    """(bytes ``rank`` sends to each rank, bytes it receives from each rank), its own part 0 both ways.

    Example:
        >>> _splits(np.array([[5, 1], [2, 0]]), 0)
        ([0, 1], [0, 2])
    """
    matrix = np.asarray(sizes, dtype=np.int64)
    send, recv = matrix[rank].tolist(), matrix[:, rank].tolist()
    send[rank] = recv[rank] = 0  # a rank's own part never crosses
    return send, recv


def _nothing_crosses(sizes: np.ndarray) -> bool:
    """Whether no rank sends another any byte (the diagonal, a rank's own part, never crosses).

    Example:
        >>> _nothing_crosses(np.array([[7, 0], [0, 3]])), _nothing_crosses(np.array([[0, 1], [0, 0]]))
        (True, False)
    """
    crossing = np.array(sizes, dtype=np.int64)
    np.fill_diagonal(crossing, 0)
    return not crossing.any()


def _send_buffer(outgoing: Sequence[bytes], send: List[int], rank: int) -> torch.Tensor:
    """The parts for the other ranks, end to end, as one uint8 tensor (one copy: a bytearray the tensor
    shares). Raises when a part's length is not its size (every rank would split the bytes wrong)."""
    for d, part in enumerate(outgoing):
        if d != rank and len(part) != send[d]:
            raise ValueError(f"odb rank {rank}: exchange_bytes got {len(part)} bytes for rank {d} but sizes "
                             f"says {send[d]}. Fix: pass the sizes gathered from these very parts "
                             f"(RankExchange.move does).")
    buffer = bytearray().join(part for d, part in enumerate(outgoing) if d != rank)
    if not buffer:
        return torch.empty(0, dtype=torch.uint8)  # torch.frombuffer refuses an empty buffer
    return torch.frombuffer(buffer, dtype=torch.uint8)


@contextlib.contextmanager
def _worker_deaths_held() -> Iterator[None]:
    """Hold SIGCHLD back from the main thread while a collective is posted. torch raises a DataLoader
    worker's death from its SIGCHLD handler on the main thread, at whatever line runs there: between the
    post and the assignment of its handle, this rank would drop a collective its peers complete with it,
    and they would wait at the next exchange for an announcement that never comes. Held back, the signal
    arrives when the block ends, with the handle in hand (``gather`` then sees the collective through)."""
    if not hasattr(signal, "pthread_sigmask") or threading.current_thread() is not threading.main_thread():
        yield  # no POSIX signals, or a thread that runs no Python signal handler
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


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


class GroupExchanges:
    """Makes the exchanges of an odb loader over torch.distributed, each on a fresh gloo group of ``ranks``
    (global ranks; None: all of the default group's), or of ``group``'s ranks. ``replicas``: the data-parallel
    replicas of those processes (odb.comm.replicas; None: each process is one), or ``pair``: this process's
    (replica, peer), every process's then gathered by the first exchange. ``world()`` says (rank, world size)
    (under replicas: this replica, the number of replicas) without a collective; calling it makes one exchange
    (a collective: it makes a group).

    Example:
        >>> GroupExchanges().world()   # no torch.distributed here: one rank
        (0, 1)
    """

    def __init__(self, group: Any = None, *, ranks: Optional[List[int]] = None, replicas: Optional[Replicas] = None,
                 pair: Optional[Tuple[int, int, int]] = None) -> None:
        self.ranks = group_ranks(group) if group is not None else ranks
        self.replicas = replicas
        self.pair = pair  # (replica, peer, replicas) of this process, where ``replicas`` is gathered
        self.spare: List[Any] = []  # (a group over a strict subset of the ranks) released groups, reused

    def world(self) -> Tuple[int, int]:
        """(rank, world size) of the data-parallel replicas this factory's exchanges span."""
        process, processes = ranks_world(self.ranks)
        if self.replicas is not None:
            return self.replicas.replica[process], self.replicas.count
        if self.pair is not None:
            return self.pair[0], self.pair[2]
        return process, processes

    def processes(self) -> int:
        """Processes the exchanges span."""
        return ranks_world(self.ranks)[1]

    def __call__(self, timeout_s: float) -> RankExchange:
        transport = GlooTransport(timeout_s, self.ranks, self.spare)
        if self.pair is not None and self.replicas is None and transport.world_size > 1:
            pairs = transport.gather(np.array(self.pair[:2], dtype=np.int64), "the replicas' layout")
            self.replicas = Replicas.of_processes(pairs)
        return kept_live(RankExchange(timeout_s, transport=transport, replicas=self.replicas))


def mesh_exchanges(mesh: Any) -> Tuple[GroupExchanges, int]:
    """The exchanges of a loader over a torch ``DeviceMesh`` (its ranks; replicas along its data-parallel
    dimensions: odb.comm.replicas.mesh_layout) and the mesh's context parallel degree ("cp", else 1)."""
    ranks = np.asarray(mesh.mesh.cpu().numpy() if hasattr(mesh.mesh, "cpu") else mesh.mesh, dtype=np.int64)
    layout = mesh_layout(ranks, mesh.mesh_dim_names)
    everyone = list(range(dist.get_world_size())) if dist.is_initialized() else [0]
    spanned = None if layout.ranks == everyone else layout.ranks
    return GroupExchanges(ranks=spanned, replicas=layout.replicas), layout.context_parallel


def peer_exchanges(process_group: Any, peer_group: Any) -> GroupExchanges:
    """The exchanges of a loader whose data-parallel group is ``process_group`` (its rank: this replica) and
    whose replica's peers are ``peer_group`` (its rank: this peer); together they must span every rank."""
    dp, peers = group_world(process_group), group_world(peer_group)
    everyone = world()[1]
    if dp[1] * peers[1] != everyone:
        raise ValueError(f"odb got process_group of {dp[1]} ranks and peer_group of {peers[1]}: {dp[1] * peers[1]} "
                         f"processes, but torch.distributed has {everyone}. Rule: the data-parallel group times the "
                         f"peers of a replica spans every rank (each rank iterates its loader). Fix: pass the "
                         f"groups of a mesh that covers every rank, or device_mesh=mesh.")
    return GroupExchanges(pair=(dp[0], peers[0], dp[1]))


def _went_through(work: Any, parts: List[torch.Tensor], local: torch.Tensor, rank: int) -> bool:
    """Whether a completed collective holds no error. torch before 2.7 cannot hand a stored error to Python
    (``Work.exception()`` raises TypeError on its exception_ptr): there, the collective went through when
    every rank's part arrived (none still holds _UNSET) and this rank's is its own message."""
    try:
        return work.exception() is None
    except TypeError:
        return all(int(p[0]) != _UNSET for p in parts) and torch.equal(parts[rank], local)


def _bytes_went_through(work: Any) -> bool:
    """Whether a completed all-to-all of bytes holds no error. The bytes have no word that tells "never
    arrived": on torch before 2.7 (``Work.exception()`` raises TypeError) it is waited once more instead, which
    returns at once for a completed collective and raises again the error it stored.

    Example (a completed collective whose error torch cannot show):
        >>> class Done:
        ...     def exception(self): raise TypeError("exception_ptr")
        ...     def wait(self): return True
        ...     def is_completed(self): return True
        >>> _bytes_went_through(Done())
        True
    """
    try:
        return work.exception() is None
    except TypeError:
        return _finish(work, attempts=1)
