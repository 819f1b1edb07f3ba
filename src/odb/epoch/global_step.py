"""One optimizer step planned across ranks (``step_plan="global"``, with ``global_batch_size``).

Each rank reads its own share of the step (the next ``global_batch_size / world_size`` positions of
its sampler's order, as the per-rank plan does: the step holds the plain loader's samples), then:

1. the header: every rank's share size, its samples' length dimensions and whether its data ended (and
   the options check, odb.epoch.ranks.RankAligner.header);
2. the step table: every rank's samples as rows of one int64 message (``StepTable``);
3. the plan: odb.plan.steps.global_plan.plan_global_step over the union of the step's samples, the same on
   every rank (pure), so that the slowest rank costs least;
4. the move: with online lengths, each rank sends the processed samples it planned for other ranks,
   pickled, through the exchange's byte move (odb.comm.protocol.RankExchange.move); with known lengths a
   sample is its dataset index, which the rank's own workers read, so nothing moves.

A sample planned for another rank is held there under a *foreign key* (``foreign_key``): negative, so it
never meets a position of that rank's own order, with its dataset index in the high bits, so a rank
resumed inside a step can read it again (map-style data).

Example:
    >>> key = foreign_key(index=12, slot=3)
    >>> key < 0, foreign_index(key)
    (True, 12)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from odb.comm.mover import move_objects
from odb.epoch.drop_last import DropLast
from odb.epoch.pool import SamplePool
from odb.epoch.ranks import RankAligner, Step
from odb.epoch.stats import EpochStats
from odb.plan.ranks.align import MicroBatchPlan
from odb.plan.steps.global_plan import GlobalStepPlan, plan_global_step
from odb.plan.steps.price_deal import deal_by_price, planned_groups
from odb.plan.windows.window import WindowPlanner

SLOT_BITS = 24  # a step's samples, all ranks together, are fewer than 2 ** 24


def foreign_key(index: int, slot: int) -> int:
    """The pool key of a sample planned here from another rank: ``slot`` (its row in the step table) keeps
    keys of one step apart, ``index`` (its dataset index) lets a resumed rank read it again."""
    return -(1 + (int(index) << SLOT_BITS) + int(slot))


def foreign_index(key: int) -> int:
    """The dataset index of a foreign key (``foreign_key``'s inverse)."""
    return (-int(key) - 1) >> SLOT_BITS


@dataclasses.dataclass(frozen=True)
class StepTable:
    """Every rank's samples of one step, rank after rank: the message layout and its reading.

    A rank's message is ``(rows, len(FIELDS) + dims)`` int64: per sample ``FIELDS`` then its lengths; rows
    past its samples have ``valid`` 0.

    Example:
        >>> one = StepTable.message(2, 1, [5], [40], [3], [0], np.array([[7]]))
        >>> table = StepTable.read(np.stack([one, one]), dims=1)
        >>> table.owner.tolist(), table.position.tolist(), table.lengths.ravel().tolist()
        ([0, 1], [5, 5], [7, 7])
    """

    FIELDS = ("valid", "position", "index", "loss_tokens", "patches")

    owner: np.ndarray
    position: np.ndarray
    index: np.ndarray
    loss_tokens: np.ndarray
    patches: np.ndarray
    lengths: np.ndarray  # (n, dims)

    @classmethod
    def message(cls, rows: int, dims: int, position: Sequence[int], index: Sequence[int],
                loss_tokens: Sequence[int], patches: Sequence[int], lengths: np.ndarray) -> np.ndarray:
        """One rank's message: its samples' rows, then empty ones up to ``rows``."""
        out = np.zeros((rows, len(cls.FIELDS) + dims), dtype=np.int64)
        n = len(position)
        out[:n, 0] = 1
        out[:n, 1], out[:n, 2], out[:n, 3], out[:n, 4] = position, index, loss_tokens, patches
        if n:
            out[:n, len(cls.FIELDS):] = np.asarray(lengths, dtype=np.int64).reshape(n, dims)
        return out

    @classmethod
    def read(cls, gathered: np.ndarray, dims: int) -> "StepTable":
        """The union of every rank's message ``gathered`` ((world, rows, fields + dims))."""
        world, rows = gathered.shape[:2]
        flat = gathered.reshape(world * rows, -1)
        valid = flat[:, 0] == 1
        owner = np.repeat(np.arange(world, dtype=np.int64), rows)[valid]
        body = flat[valid]
        return cls(owner, body[:, 1], body[:, 2], body[:, 3], body[:, 4], body[:, len(cls.FIELDS):][:, :dims])

    def __len__(self) -> int:
        return len(self.owner)

    def meta(self, u: int) -> Tuple[Tuple[int, ...], int, int]:
        """Row ``u``'s sample meta (lengths, supervised tokens, image patches), as odb.data.source measures it."""
        return tuple(int(v) for v in self.lengths[u]), int(self.loss_tokens[u]), int(self.patches[u])


class GlobalStep:
    """This rank's side of a step planned across ranks. It reads the pool (lengths, supervised tokens, patches
    of its own samples), exchanges through ``aligner`` (header, confirmations, announcements) and ``exchange``
    (the step table, the move), and hands samples planned here from other ranks to ``register(key, index,
    sample, meta)``. ``move_samples``: False with known lengths (a sample is its dataset index);
    ``oversize_policy(policy, length)`` and ``check_length(longest)`` are the window budget's
    (odb.epoch.budget)."""

    def __init__(self, aligner: RankAligner, exchange: Any, planner: WindowPlanner, pool: SamplePool,
                 stats: EpochStats, *, epoch: int, step_samples: int, drops: DropLast, move_samples: bool,
                 register: Callable[[int, int, Any, Any], None], oversize_policy: Callable[[str, int], str],
                 check_length: Callable[[int], None], tables: Any = None) -> None:
        self.aligner, self.exchange, self.planner, self.pool, self.stats = aligner, exchange, planner, pool, stats
        # known lengths and a stride-sharded sampler: every step's header and table computed here
        # (odb.epoch.local_table.LocalTables); the exchange checks them once per epoch
        self.tables = tables
        self.epoch, self.step_samples, self.drops = epoch, step_samples, drops
        self.move_samples, self.register = move_samples, register
        self.oversize_policy, self.check_length = oversize_policy, check_length
        self.rank, self.world = exchange.rank, exchange.world_size

    def plan(self, ids: List[int], final: bool, window_index: int, proposal: Optional[np.ndarray]) -> List[Step]:
        """This rank's micro-batches of the step whose own share is ``ids`` (positions in the pool; ``final``:
        this rank's data has ended); sets the aligner's ``all_done`` once every rank's data has ended."""
        aligner, where = self.aligner, f"epoch {self.epoch}, step window {window_index}"
        kept = self.drops.kept(len(ids), self.step_samples) if final and self.drops.unit is not None else len(ids)
        if kept < len(ids):  # this rank's partial last batch of the user's, as its own loop's drop_last drops it
            self.stats.dropped_samples += len(ids) - kept
            self.pool.forget(ids[kept:])
            ids = ids[:kept]
        dims = self.pool.lengths(ids).shape[1] if ids else 0
        computed = None
        if self.tables is not None:
            header, computed = self._computed(ids, dims, final, window_index, where, proposal)
        else:
            header = aligner.header([len(ids), dims, int(final), 0], where, proposal)
        all_final = bool(header[:, 2].all())
        dims = int(header[:, 1].max())
        if dims == 0:  # no rank has a sample left
            aligner.all_done = all_final
            return []
        if len(set(header[header[:, 0] > 0, 1].tolist())) > 1:
            raise ValueError(f"odb rank {self.rank}: the ranks' samples have different numbers of length "
                             f"dimensions ({header[:, 1].tolist()} by rank): length_fn must return as many lengths "
                             f"for every sample. Fix: return one length (or one per field) for every sample.")
        table = computed if computed is not None else self._gather_table(ids, dims, where)
        if self.drops.enabled and self.drops.unit is None and all_final and len(table) < self.step_samples * self.world:
            self.stats.dropped_samples += len(ids)  # a partial last optimizer step, no batch of the user's to keep
            self.pool.forget(ids)
            aligner.all_done = True
            return []
        planned = self._planned(table)
        if aligner.prices_ready:
            planned = self._deal_by_price(table, planned, where)
        if planned.micro_steps > self.step_samples:  # the per-step messages hold one entry per micro-step
            raise RuntimeError(f"odb rank {self.rank}: the step planned across ranks has {planned.micro_steps} "
                               f"micro-steps, more than the {self.step_samples} samples of a rank's share that the "
                               f"step's messages have room for (samples over the budget planned alone add "
                               f"micro-steps). Fix: pass step_plan='rank', or oversize='skip'; please report it.")
        placed = Placement.of(planned, len(table))
        self._hand_over(table, placed, where)
        steps = self._steps(table, planned, placed)
        aligner.steps_exchanged(len(steps))
        aligner.all_done = all_final
        return steps

    def _computed(self, ids: List[int], dims: int, final: bool, window_index: int, where: str,
                  proposal: Optional[np.ndarray]) -> Tuple[np.ndarray, StepTable]:
        """Every rank's header and the step table, computed here from the known lengths (no collective); the
        epoch's first step exchanges a header with the tables' digest, so ranks that would compute other
        tables (or run other options) stop at once."""
        tables = self.tables
        if not tables.checked:
            first = self.aligner.header([len(ids), dims, int(final), tables.digest], where, proposal)
            if len(set(first[:, 3].tolist())) > 1:
                raise ValueError(f"odb rank {self.rank}: the ranks computed different step tables from their samplers "
                                 f"and lengths (digests {first[:, 3].tolist()} by rank). Rule: with lengths= every rank "
                                 f"plans every step from (sampler seed, epoch, world size, lengths), so they must be "
                                 f"equal on every rank. Fix: pass the same lengths= and sampler seed on every rank.")
            tables.checked = True
            self.aligner.due.confirms = False  # no exchange on this thread from now on: the step exchange detects failures
        tables.check_share(window_index, ids, final)
        unit = self.drops.unit

        def drop(n: int, ended: bool) -> int:
            return self.drops.kept(n, self.step_samples) if ended and unit is not None else n

        return tables.step(window_index, dims=tables.lengths.shape[1], drop=drop)

    def _gather_table(self, ids: List[int], dims: int, where: str) -> StepTable:
        pool = self.pool
        side = pool.side(ids)
        message = StepTable.message(self.step_samples, dims, ids, pool.indices(ids), side[:, 1], side[:, 0],
                                    pool.lengths(ids))
        self.aligner.expect(message.shape)
        gathered = self.exchange.all_gather(message, where)
        self.aligner.expect(None)
        return StepTable.read(gathered, dims)

    def _planned(self, table: StepTable) -> GlobalStepPlan:
        """The step's plan over ``table`` (the same on every rank); samples over the budget follow the oversize
        policy: refused on every rank, skipped (forgotten by their owner) or planned alone."""
        planner, cfg = self.planner, self.planner.cfg
        side = np.stack([table.patches, table.loss_tokens], axis=1) if self.aligner.side else None
        if cfg.oversize != "skip":
            self.check_length(int(table.lengths.sum(axis=1).max()))  # refuses what no batch can hold (auto's cap)
        planned = plan_global_step(table.lengths, self.world, planner.cost, planner.step_overhead(), side,
                                   alone=cfg.oversize == "alone" and not cfg.auto,
                                   max_micro_steps=self.step_samples)  # what the step's messages hold
        if not len(planned.oversize):
            return planned
        alone: List[int] = []
        for u in planned.oversize.tolist():
            policy = self.oversize_policy(cfg.oversize, int(table.lengths[u].sum()))
            if policy == "error":
                raise ValueError(
                    f"sample {int(table.index[u])} (rank {int(table.owner[u])}'s) has length "
                    f"{table.lengths[u].tolist()} and {int(table.patches[u])} image patches, so alone it exceeds "
                    f"token_budget={planner.costs.token_budget}. Rule: oversize='error' refuses such samples. Fix: "
                    f"raise token_budget, truncate samples (e.g. tokenizer max_length), or pass oversize='alone' "
                    f"(own batch) or 'skip'.")
            if policy == "alone":
                alone.append(u)
                self.stats.oversize_alone += int(table.owner[u] == self.rank)
            else:
                self.stats.oversize_skipped += int(table.owner[u] == self.rank)
                if table.owner[u] == self.rank:
                    self.pool.forget([int(table.position[u])])
        return with_alone(planned, alone, self.world)

    def _deal_by_price(self, table: StepTable, planned: GlobalStepPlan, where: str) -> GlobalStepPlan:
        """``planned``'s micro-batches dealt again by the pairing criterion's prices (balance="time": predicted
        seconds), the mean of every process's price for each, so every rank deals alike (odb.plan.steps.price_deal);
        the plan as it is where any rank's model gives no price for one of them."""
        groups = planned_groups(planned)
        cost = self.planner.cost
        side = np.stack([table.patches, table.loss_tokens], axis=1)
        prices = [self.aligner.pairing.price(cost.pad(table.lengths[g]), side[g]) for g in groups]
        message = np.array([-1 if p is None else p for p in prices], dtype=np.int64)
        self.aligner.expect(message.shape)
        # every process's prices (the peers of a replica each price with their own model): all agree on the mean
        gathered = self.exchange.all_gather(message, where, every_process=True).reshape(-1, len(groups))
        self.aligner.expect(None)
        if (gathered < 0).any():
            return planned
        self.stats.price_dealt_steps += 1
        costs = np.array([cost.group_cost(table.lengths[g], side[g] if self.aligner.side else None) for g in groups],
                         dtype=np.float64)
        return deal_by_price(planned, gathered.mean(axis=0), costs, self.planner.step_overhead())

    def _hand_over(self, table: StepTable, placed: "Placement", where: str) -> None:
        """Samples planned on another rank than their owner's go there: pickled through the exchange (online
        lengths) or as their dataset index (known lengths); this rank holds what is planned here."""
        dest = placed.rank
        mine, owned = dest == self.rank, table.owner == self.rank
        leaving = np.flatnonzero(owned & ~mine & (dest >= 0))
        arriving = np.flatnonzero(mine & ~owned)
        if not self.move_samples:
            self.pool.forget(table.position[leaving].tolist())
            for u in arriving.tolist():
                self.register(foreign_key(table.index[u], u), int(table.index[u]), int(table.index[u]), table.meta(u))
            return
        self.aligner.expect((self.world,))
        outgoing: List[List[Tuple[int, Any]]] = [[] for _ in range(self.world)]
        for u in leaving.tolist():
            sample = self.pool.pop([int(table.position[u])])[0][0]
            outgoing[int(dest[u])].append((u, sample))
        incoming, counts = move_objects(self.exchange, [part or None for part in outgoing], where)
        self.aligner.expect(None)
        for part in incoming:
            for u, sample in part or ():
                self.register(foreign_key(table.index[u], u), int(table.index[u]), sample, table.meta(u))
        # what moving cost this rank: samples and bytes sent, seconds from pickling to the last sample unpickled
        self.stats.moved_samples += counts.sent
        self.stats.moved_bytes += counts.sent_bytes
        self.stats.move_s += counts.seconds

    def _steps(self, table: StepTable, planned: GlobalStepPlan, placed: "Placement") -> List[Step]:
        """This rank's micro-batches (None: a ghost) with every micro-step's global figures."""
        world, m = self.world, planned.micro_steps
        cells = world * m
        rows = placed.cell >= 0
        cell = placed.cell[rows]
        samples = np.bincount(cell, minlength=cells).reshape(world, m)
        loss = np.bincount(cell, weights=table.loss_tokens[rows], minlength=cells).reshape(world, m)
        longest = np.zeros(cells)
        np.maximum.at(longest, cell, table.lengths[rows].sum(axis=1).astype(np.float64))
        padded = samples * longest.reshape(world, m)
        mean = padded.mean(axis=0)
        imbalance = np.where(mean > 0, padded.max(axis=0) / np.maximum(mean, 1e-9), 1.0)
        out: List[Step] = []
        for j, g in enumerate(planned.ranks[self.rank]):
            plan = MicroBatchPlan(j if len(g) else None, int(samples[:, j].sum()), int(round(loss[:, j].sum())),
                            int(round(loss[self.rank, j])), int(samples[self.rank, j]), float(imbalance[j]))
            keys = [int(table.position[u]) if table.owner[u] == self.rank else foreign_key(table.index[u], u)
                    for u in g.tolist()]
            out.append((plan, np.array(keys, dtype=np.int64) if len(g) else None))
        return out


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a plan puts each row of the step table: its rank, and its cell ``rank x micro_steps + micro-step``
    (-1: not planned, an oversize sample skipped).

    Example:
        >>> plan = GlobalStepPlan([[np.array([1]), np.array([0])], [np.array([2]), np.empty(0, dtype=np.int64)]],
        ...                       np.empty(0, dtype=np.int64), np.zeros(2), 0.0)
        >>> placed = Placement.of(plan, 3)
        >>> placed.rank.tolist(), placed.cell.tolist()
        ([0, 0, 1], [1, 0, 2])
    """

    rank: np.ndarray
    cell: np.ndarray

    @classmethod
    def of(cls, planned: GlobalStepPlan, rows: int) -> "Placement":
        m = planned.micro_steps
        groups = [g for gs in planned.ranks for g in gs]
        sizes = np.fromiter((len(g) for g in groups), dtype=np.int64, count=len(groups))
        cell = np.full(rows, -1, dtype=np.int64)
        if sizes.sum():
            cell[np.concatenate(groups).astype(np.int64)] = np.repeat(np.arange(len(groups), dtype=np.int64), sizes)
        rank = np.where(cell >= 0, cell // max(m, 1), -1)
        return cls(rank, cell)


def with_alone(planned: GlobalStepPlan, alone: List[int], world: int) -> GlobalStepPlan:
    """``planned`` with each of the ``alone`` positions (samples over the budget, oversize='alone') as a
    micro-batch of its own, in micro-steps added at the end (a rank without one runs a ghost there).

    Example:
        >>> plan = GlobalStepPlan([[np.array([0])], [np.array([1])]], np.array([2]), np.zeros(2), 0.0)
        >>> [[g.tolist() for g in groups] for groups in with_alone(plan, [2], 2).ranks]
        [[[0], [2]], [[1], []]]
    """
    if not alone:
        return planned
    ranks = [list(groups) for groups in planned.ranks]
    extra = -(-len(alone) // world)
    for k in range(extra * world):
        r = k % world
        ranks[r].append(np.array([alone[k]], dtype=np.int64) if k < len(alone) else np.empty(0, dtype=np.int64))
    return dataclasses.replace(planned, ranks=ranks, oversize=np.empty(0, dtype=np.int64))


def foreign_keys(keys: Sequence[int]) -> Dict[int, int]:
    """key -> dataset index of the foreign keys among ``keys``.

    Example:
        >>> foreign_keys([4, foreign_key(9, 0)])
        {-150994945: 9}
    """
    return {int(k): foreign_index(k) for k in keys if int(k) < 0}
