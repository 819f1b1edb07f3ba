"""Data-parallel replicas: the processes of an exchange grouped into replicas whose peers get the same batches.

Under tensor, context, sequence or pipeline parallelism one data-parallel *replica* spans several
processes, its *peers*: they run one model together and must be handed the same batch at every
micro-step (a collective inside the model otherwise hangs or mixes two batches). odb plans over the
replicas only: a loader's rank is its replica, its world the number of replicas.

Every peer plans for itself, from the same inputs: the same sampler shard (``DistributedSampler(
num_replicas=replicas, rank=replica)``), the same seed and options, the same samples, and every
decision that a process makes from what it measures (``token_budget="auto"``'s proposals, whether its
step-time model prices, its prices) agreed through messages every process of the world sees. So the
peers compute the same plan by construction, and no batch crosses from one peer to another; the
alternative, one peer loading and broadcasting each batch, would send every batch over the replica's
links and make the replica wait for one process's workers.

``Replicas`` (pure) says which replica and which peer each process is, reads a gathered message of
every process as one row per replica (its first peer's, the *leader*), finds a peer whose row differs
from its leader's (the exchange then raises ``ODBPeerMismatch``), and maps a move of bytes between
replicas onto the processes: peer k of one replica sends to peer k of another.

Example (2 replicas x 2 peers, processes laid out replica-major as a DeviceMesh("dp", "tp") is):
    >>> layout = Replicas.grid(2, 2)
    >>> layout.replica, layout.peer, layout.leaders.tolist()
    ((0, 0, 1, 1), (0, 1, 0, 1), [0, 2])
    >>> gathered = np.array([[5], [5], [7], [8]])
    >>> layout.rows(gathered).ravel().tolist(), layout.mismatch(gathered)
    ([5, 7], (3, 2))
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np


@dataclasses.dataclass(frozen=True)
class Replicas:
    """``replica[p]`` and ``peer[p]`` of every process p of an exchange (p: its rank in the exchange's group).
    Every replica has the same number of peers, each peer index once."""

    replica: Tuple[int, ...]
    peer: Tuple[int, ...]

    def __post_init__(self) -> None:
        replica, peer = np.asarray(self.replica, dtype=np.int64), np.asarray(self.peer, dtype=np.int64)
        if replica.shape != peer.shape or not len(replica):
            raise ValueError(f"Replicas got replica={self.replica!r} and peer={self.peer!r}: one entry per process "
                             f"each, at least one. Fix: pass both for every process of the exchange.")
        count, peers = int(replica.max()) + 1, int(peer.max()) + 1
        cells = replica * peers + peer
        if replica.min() < 0 or peer.min() < 0 or count * peers != len(replica) or \
                len(np.unique(cells)) != len(replica):
            raise ValueError(f"Replicas got replica={self.replica!r}, peer={self.peer!r}: every replica 0..{count - 1} "
                             f"must have the peers 0..{peers - 1} once each (a grid of replicas x peers). Fix: "
                             f"group the processes into replicas of equal size, e.g. a DeviceMesh's data-parallel "
                             f"dimensions against the others.")
        table = np.empty((peers, count), dtype=np.int64)  # table[k, r]: the process of peer k of replica r
        table[peer, replica] = np.arange(len(replica))
        object.__setattr__(self, "_table", table)

    @classmethod
    def grid(cls, replicas: int, peers: int) -> "Replicas":
        """Processes laid out replica-major: process ``r * peers + k`` is peer k of replica r."""
        return cls(tuple(p // peers for p in range(replicas * peers)), tuple(p % peers for p in range(replicas * peers)))

    @classmethod
    def of_processes(cls, pairs: np.ndarray) -> "Replicas":
        """From every process's (replica, peer) pair, in process order ((processes, 2) array)."""
        pairs = np.asarray(pairs, dtype=np.int64).reshape(-1, 2)
        return cls(tuple(int(v) for v in pairs[:, 0]), tuple(int(v) for v in pairs[:, 1]))

    @property
    def count(self) -> int:
        """Replicas (the loader's world size)."""
        return max(self.replica) + 1

    @property
    def peers(self) -> int:
        """Processes per replica."""
        return max(self.peer) + 1

    @property
    def processes(self) -> int:
        return len(self.replica)

    @property
    def leaders(self) -> np.ndarray:
        """(count,) the process of each replica's peer 0."""
        return self.members(0)

    def members(self, peer: int) -> np.ndarray:
        """(count,) the process of peer ``peer`` of each replica, in replica order."""
        return self._table[peer]

    def rows(self, gathered: np.ndarray) -> np.ndarray:
        """One row per replica (its leader's) of a message gathered from every process."""
        return np.asarray(gathered)[self.leaders]

    def mismatch(self, gathered: np.ndarray) -> Optional[Tuple[int, int]]:
        """(process, its leader) of the first process whose row of ``gathered`` differs from its leader's, else
        None."""
        gathered = np.asarray(gathered)
        lead = self.leaders[np.asarray(self.replica)]  # each process's leader
        differs = (gathered != gathered[lead]).reshape(len(lead), -1).any(axis=1)
        first = np.flatnonzero(differs)
        return (int(first[0]), int(lead[first[0]])) if len(first) else None

    def process_sizes(self, sizes: np.ndarray) -> np.ndarray:
        """(processes, processes) bytes each process sends each other, from ``sizes`` ((processes, count): what
        each process sends each replica): peer k of a replica sends to peer k of the others only."""
        sizes = np.asarray(sizes, dtype=np.int64)
        out = np.zeros((self.processes, self.processes), dtype=np.int64)
        for k in range(self.peers):
            members = self.members(k)
            out[np.ix_(members, members)] = sizes[members]
        np.fill_diagonal(out, 0)
        return out

    def process_parts(self, outgoing: Sequence[bytes], process: int) -> List[bytes]:
        """This process's parts for every process, from its parts for every replica (``outgoing``)."""
        k = self.peer[process]
        return [bytes(outgoing[self.replica[d]]) if self.peer[d] == k and d != process else b""
                for d in range(self.processes)]

    def replica_parts(self, incoming: Sequence[bytes], process: int, own: bytes) -> List[bytes]:
        """What each replica sent this process's replica (``own`` for its own), from what each process sent it."""
        members = self.members(self.peer[process])
        return [own if r == self.replica[process] else incoming[int(members[r])] for r in range(self.count)]


DATA_PARALLEL_DIMS = ("dp", "dp_replicate", "dp_shard")  # a DeviceMesh's data-parallel dimension names
CONTEXT_PARALLEL_DIM = "cp"


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """What a device mesh says to a loader: the global ranks its exchanges span (in order), their replicas and
    the context parallel degree."""

    ranks: List[int]
    replicas: Replicas
    context_parallel: int


def mesh_layout(ranks: np.ndarray, dim_names: Optional[Sequence[str]]) -> MeshLayout:
    """The layout of a device mesh given as its array of global ranks (one axis per dimension) and its dimension
    names: the data-parallel dimensions ("dp", or "dp_replicate" and/or "dp_shard") number the replicas
    (row-major, in the mesh's order, as a flattened "dp" dimension does); every other dimension (tensor, context,
    sequence, pipeline, expert parallel) numbers the peers of a replica.

    Example (dp 2 x tp 2 over ranks 0..3, and dp_replicate 2 x dp_shard 2 x cp 2 over 8):
        >>> layout = mesh_layout(np.arange(4).reshape(2, 2), ("dp", "tp"))
        >>> layout.replicas.replica, layout.replicas.peer, layout.context_parallel
        ((0, 0, 1, 1), (0, 1, 0, 1), 1)
        >>> layout = mesh_layout(np.arange(8).reshape(2, 2, 2), ("dp_replicate", "dp_shard", "cp"))
        >>> layout.replicas.replica[:4], layout.context_parallel
        ((0, 0, 1, 1), 2)
    """
    ranks = np.asarray(ranks, dtype=np.int64)
    names = tuple(dim_names or ())
    if len(names) != ranks.ndim:
        raise ValueError(f"odb got a device mesh of shape {tuple(ranks.shape)} with dimension names {dim_names!r}: "
                         f"odb plans over the data-parallel dimensions, which it finds by name. Fix: build the mesh "
                         f"with mesh_dim_names, e.g. init_device_mesh('cuda', (dp, tp), mesh_dim_names=('dp', 'tp')).")
    merged = [n for n in names if n.startswith("dp") and n not in DATA_PARALLEL_DIMS]
    if merged:
        raise ValueError(f"odb got a device mesh with dimensions {names}: {merged} merge data parallelism with "
                         f"another kind (a flattened dimension such as dp_shard_cp), so odb cannot tell replicas "
                         f"from peers. Fix: pass the mesh whose dimensions are separate, e.g. ('dp_replicate', "
                         f"'dp_shard', 'cp', 'tp'), the one the flattened dimension was made from.")
    dp_axes = [k for k, n in enumerate(names) if n in DATA_PARALLEL_DIMS]
    if not dp_axes:
        raise ValueError(f"odb got a device mesh with dimensions {names} and none of {DATA_PARALLEL_DIMS}: odb plans "
                         f"over the data-parallel replicas and gives every other dimension's ranks the same batches. "
                         f"Fix: name the data-parallel dimension 'dp' (or 'dp_replicate' and 'dp_shard'), or give it "
                         f"a dimension of size 1 when there is one replica.")
    peer_axes = [k for k in range(ranks.ndim) if k not in dp_axes]
    order = np.argsort(ranks, axis=None)
    coords = np.array(np.unravel_index(order, ranks.shape)).T  # one row per rank, in rank order
    shape = np.array(ranks.shape)
    replica = np.ravel_multi_index(tuple(coords[:, dp_axes].T), tuple(shape[dp_axes]))
    peer = np.ravel_multi_index(tuple(coords[:, peer_axes].T), tuple(shape[peer_axes])) if peer_axes else \
        np.zeros(len(order), dtype=np.int64)
    cp = int(shape[names.index(CONTEXT_PARALLEL_DIM)]) if CONTEXT_PARALLEL_DIM in names else 1
    return MeshLayout(sorted(int(r) for r in ranks.ravel()), Replicas(tuple(int(v) for v in replica),
                                                                      tuple(int(v) for v in peer)), cp)
