"""Known lengths: every rank computes each optimizer step's table itself, so planning exchanges nothing.

With ``lengths=`` and a stride-sharded sampler (``odb.ShardSampler`` or ``DistributedSampler``), rank r's
order is ``global_order[r::world]`` (odb.data.sampling), and step w holds the next ``step_samples`` positions of
every rank's order. So every rank can write the step table (odb.epoch.global_step.StepTable: positions,
dataset indices, lengths) and header (share sizes, whose data ended) of every rank from (sampler seed, epoch,
world, lengths), and plan the step as the exchange would have let it: the plan is a pure function of them.
The batch thread then runs no collective per step; the epoch's first header still goes through the exchange,
with a digest of the global order and the lengths, so ranks that would compute different tables (or that
run other options) stop at once. Failures reach the other ranks at the step exchange of supervised tokens
(odb.epoch.known), which the training thread runs once per optimizer step.

Example (2 ranks, 4 samples per rank per step, rank 1's view of step 2):
    >>> tables = LocalTables(np.arange(12), world=2, lengths=np.arange(12)[:, None] + 1, step_samples=4, rank=1)
    >>> header, table = tables.step(2, dims=1, drop=lambda n, final: n)
    >>> header[:, :3].tolist(), table.index.tolist(), table.position.tolist()
    ([[2, 1, 1], [2, 1, 1]], [8, 10, 9, 11], [4, 5, 4, 5])
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, List, Optional, Tuple

import numpy as np

from odb.epoch.global_step import StepTable
from odb.data.sampling import global_order, stride_sharded


class LocalTables:
    """The step tables of an epoch, every rank's, from its ``global_order`` (rank r reads ``[r::world]``) and
    the dataset's ``lengths`` ((n, D)); ``rank``: this rank (its shares are checked against what it read)."""

    def __init__(self, global_order: np.ndarray, *, world: int, lengths: np.ndarray, step_samples: int,
                 rank: int) -> None:
        order = np.asarray(global_order, dtype=np.int64)
        self.orders: List[np.ndarray] = [order[r::world] for r in range(world)]
        self.lengths = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1)
        self.step_samples, self.rank, self.world = int(step_samples), int(rank), int(world)
        h = hashlib.blake2b(digest_size=8)
        h.update(order.tobytes())
        h.update(self.lengths.tobytes())
        self.digest = int.from_bytes(h.digest(), "little") & ((1 << 62) - 1)  # sent with the first header
        self.checked = False  # the ranks compared their digests (the epoch's first header)

    def share(self, rank: int, window: int) -> Tuple[np.ndarray, bool]:
        """(positions of ``rank``'s order in step ``window`` (1-based), whether its data has ended with them)."""
        s, n = self.step_samples, len(self.orders[rank])
        start, end = min((window - 1) * s, n), min(window * s, n)
        return np.arange(start, end, dtype=np.int64), end >= n

    def step(self, window: int, *, dims: int, drop: Callable[[int, bool], int]) -> Tuple[np.ndarray, StepTable]:
        """(every rank's header fields [share size, length dimensions, data ended, 0], the step table) of step
        ``window``; ``drop(n, ended)``: how many of a share of n samples the loader's drop_last keeps."""
        header = np.zeros((self.world, 4), dtype=np.int64)
        owners, positions = [], []
        for r in range(self.world):
            pos, ended = self.share(r, window)
            pos = pos[:drop(len(pos), ended)]
            header[r] = (len(pos), dims if len(pos) else 0, int(ended), 0)
            owners.append(np.full(len(pos), r, dtype=np.int64))
            positions.append(pos)
        owner, position = np.concatenate(owners), np.concatenate(positions)
        index = np.concatenate([self.orders[r][p] for r, p in enumerate(positions)]) if len(position) else \
            np.zeros(0, dtype=np.int64)
        zeros = np.zeros(len(position), dtype=np.int64)
        return header, StepTable(owner, position, index, zeros, zeros, self.lengths[index][:, :dims])

    def check_share(self, window: int, ids: List[int], final: bool) -> None:
        """Raise if what this rank read for step ``window`` is not the share its table says (a bug, or a sampler
        that does not follow the stride rule)."""
        pos, ended = self.share(self.rank, window)
        if list(ids) != pos[:len(ids)].tolist() or (final and not ended):
            raise RuntimeError(f"odb rank {self.rank}: step {window} read positions {list(ids)[:8]}... (data ended: "
                               f"{final}), but the step table computed from the sampler says {pos[:8].tolist()}... "
                               f"(ended: {ended}). This is a bug in odb; please report it. Fix meanwhile: "
                               f"step_plan='global' with online lengths (drop lengths=), which exchanges the table.")


def local_tables(sampler: Any, *, epoch: int, rank: int, world: int, lengths: Optional[np.ndarray],
                 step_samples: Optional[int], own_order: Optional[List[int]] = None) -> Optional[LocalTables]:
    """The epoch's ``LocalTables`` where its steps can be computed without an exchange: known ``lengths``, a step
    of ``step_samples`` per rank, a stride-sharded sampler over ``world`` ranks; else None. ``own_order``: this
    rank's order (the fast global order must reproduce it; else every rank's sampler is built)."""
    if lengths is None or step_samples is None or world <= 1 or not stride_sharded(sampler) or \
            getattr(sampler, "num_replicas", None) != world:
        return None
    epoch = int(getattr(sampler, "epoch", epoch))  # the order the sampler gives now (its own set_epoch)

    def own(candidate: Optional[np.ndarray]) -> bool:
        return candidate is not None and (own_order is None or candidate[rank::world].tolist() == list(own_order))

    order = fast_global_order(sampler, world, epoch)
    if not own(order):
        order = global_order(sampler, world, epoch)  # (one sampler per rank, through its public constructor)
    if not own(order):
        return None  # a sampler that does not give this rank its stride of one order: exchange the tables
    return LocalTables(order, world=world, lengths=lengths, step_samples=step_samples, rank=rank)


def fast_global_order(sampler: Any, world: int, epoch: int) -> Optional[np.ndarray]:
    """The global order from one sampler of one replica (its whole permutation), extended as the sampler's kind
    extends it for ``world`` ranks (DistributedSampler: padded with its first indices to a multiple of world,
    or cut to one with drop_last; odb.ShardSampler: as it is). The caller checks it against its own order."""
    from torch.utils.data import DistributedSampler

    from odb.data.sampling import ShardSampler

    if isinstance(sampler, ShardSampler):
        one = ShardSampler(sampler.data_source, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed)
    elif isinstance(sampler, DistributedSampler):
        one = DistributedSampler(sampler.dataset, num_replicas=1, rank=0, shuffle=sampler.shuffle, seed=sampler.seed,
                                 drop_last=False)
    else:
        return None
    one.set_epoch(epoch)
    order = np.fromiter(one, dtype=np.int64)
    if isinstance(sampler, DistributedSampler) and len(order):
        if sampler.drop_last:
            order = order[:len(order) // world * world]
        else:
            short = -len(order) % world
            order = np.concatenate([order] + [order] * (short // len(order)) + [order[:short % len(order)]])
    return order
