"""How one rank fits its planned groups to the steps all ranks agreed on.

Exchange the window header; the decisions are pure functions of the exchanged integers
(odb.plan.ranks.fitting, odb.plan.ranks.align): the step count, then what to defer, what to draw
from the carry, whether to re-balance the last window, what to split, how many ghosts.
The aligner applies them through the window planner's methods (its carry), reads the
sample pool (lengths, loss tokens), exchanges per-step summaries and orders the steps
identically on every rank.

Steps are confirmed once made, ``CONFIRM_STEPS`` at a time (``confirm``), before any of
them reaches the training loop, so a rank whose batch failed stops every rank at the same
step; ``announce`` joins the next exchange with a failure or a stop. The header and the
confirmation have the same layout and size (``HeaderMessage``: status, 4 header fields, the plan options'
fingerprint), so a rank that fails anywhere but between a header and its summaries knows
the shape the others expect (``DueExchanges``: what this rank still owes). The header also
carries this rank's encoded budget proposal (odb.plan.auto.auto_budget.BudgetPlan, 3 ints; zeros without
token_budget="auto") and whether its pairing criterion (``pairing``, odb.plan.ranks.pairing: ``balance``)
prices this window (1 int; zeros in a confirmation). Where the window budget proposes (``align``'s
``proposal``: token_budget="auto"), ``agreed_plan`` is the most conservative of every rank's proposals
(``agree``), which the window budget applies to the next window; the ranks pair by the criterion's price only in a window where every rank's is ready (else
all by the planner's cost, so no step pairs one rank's seconds with another's tokens).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from odb.comm.agreement import agreed_values, check_agreement, fingerprint
from odb.comm.protocol import ODBOptionMismatch
from odb.epoch.pool import SamplePool, side_needed
from odb.plan.ranks.align import MicroBatchPlan, global_steps, local_steps, shared_step_order
from odb.plan.auto.budget_plan import PLAN_FIELDS, agree
from odb.plan.ranks.fitting import cost_rank_order, decide_splits, decide_trim, decide_window, must_emit
from odb.plan.ranks.pairing import Pairing, TokenPairing
from odb.plan.windows.planner import balanced_partition
from odb.plan.windows.window import WindowPlanner

Step = Tuple[MicroBatchPlan, Optional[np.ndarray]]
PLAN_SIZE = PLAN_FIELDS  # int64 of an encoded BudgetPlan (odb.plan.auto.budget_plan.BudgetPlan.encode)
AUTO_SIZE = PLAN_SIZE + 1  # the header's auto part: the encoded plan, and whether this rank's time model predicts
CONFIRM_STEPS = 4  # steps confirmed by one exchange (the same on every rank: it shapes the protocol)
BODY_FIELDS = 4  # per step of a window's body: pair cost, samples, supervised tokens, longest sample (probe)


@dataclasses.dataclass(frozen=True)
class FitCounts:
    """What one window's fit did on this rank (the epoch's counters add them up)."""

    deferred: int = 0  # groups put back into the carry
    from_carry: int = 0  # groups taken from the carry
    split: int = 0  # groups cut in halves


class HeaderMessage:
    """The layout of a window header and of a confirmation (one size: a rank that fails between them knows the
    shape the others expect): ``FIELDS`` int64 fields, the auto part (``AUTO_SIZE``: this rank's encoded budget
    plan proposal, zeros without one, then whether its pairing criterion prices this window) and the
    fingerprint of the options every rank must agree on (``values``, odb.comm.agreement). Reading every rank's
    message checks the options and keeps their auto parts; ``agree`` then reads what the last header said.

    Example:
        >>> from odb.config import ODBConfig
        >>> layout = HeaderMessage(agreed_values(ODBConfig(token_budget=64), shuffle=False))
        >>> one = layout.message([3, 1, 0, 7], None, ready=True)
        >>> len(one) == layout.size, layout.read(np.stack([one, one]), rank=0).tolist()
        (True, [[3, 1, 0, 7], [3, 1, 0, 7]])
        >>> layout.agree(proposed=False)
        >>> layout.agreed_plan, layout.ready_all
        (None, True)
    """

    FIELDS = 4

    def __init__(self, values: Dict[str, Any]) -> None:
        self.values = values
        self.fingerprint = fingerprint(values)
        self.plans = np.zeros((0, AUTO_SIZE), dtype=np.int64)  # every rank's auto part of the last message read
        # Every header has room for a plan proposal (zeros without token_budget="auto"), so that ranks with
        # and without "auto" exchange messages of one shape and the options check names the difference.
        self.agreed_plan: Any = None  # agree() of every rank's proposal at the last header (None: none sent)
        self.ready_all = False  # whether every rank's pairing criterion priced the window of the last header

    @property
    def size(self) -> int:
        return self.FIELDS + AUTO_SIZE + len(self.fingerprint)

    def message(self, fields: List[int], plan: Optional[np.ndarray], *, ready: bool) -> np.ndarray:
        """This rank's message: ``fields``, its encoded ``plan`` proposal (None: zeros), ``ready``, the
        fingerprint."""
        sent = np.zeros(AUTO_SIZE, dtype=np.int64)
        if plan is not None:
            sent[:PLAN_SIZE] = np.asarray(plan, dtype=np.int64)
        sent[PLAN_SIZE] = int(ready)
        return np.concatenate((np.asarray(fields, dtype=np.int64), sent, self.fingerprint))

    def read(self, gathered: np.ndarray, rank: int) -> np.ndarray:
        """Every rank's fields ((world, FIELDS)) of the messages ``gathered``; refuses ranks whose loaders plan
        under other options (ODBOptionMismatch)."""
        f, p = self.FIELDS, AUTO_SIZE
        self.plans = gathered[:, f:f + p]
        check_agreement(gathered[:, f + p:], self.values, rank)
        return gathered[:, :f]

    def agree(self, proposed: bool) -> None:
        """What the header just read says: the ranks' agreement on their proposals (``proposed``: this rank
        sent one) and whether every rank's criterion prices the window."""
        self.agreed_plan = agree(self.plans[:, :PLAN_SIZE]) if proposed else None
        self.ready_all = bool((self.plans[:, PLAN_SIZE] == 1).all())


@dataclasses.dataclass
class DueExchanges:
    """What this rank still owes the exchange: steps exchanged and not yet confirmed (made), the shape of
    the next exchange when it is neither a header nor a confirmation (``body``: the summaries due after a
    header, a global step's table or move; None: a header's), and whether made steps are confirmed through
    the exchange at all (``confirms``; False: steps computed on every rank without an exchange,
    odb.epoch.local_table, whose failures reach the others at the step exchange of known lengths)."""

    unconfirmed: int = 0
    body: Optional[Tuple[int, ...]] = None
    confirms: bool = True


class RankAligner:
    """One rank's side of the per-window alignment (``exchange`` is None on a single process).

    It decides nothing itself (odb.plan.ranks.fitting does, over exchanged integers): it exchanges,
    then applies the decisions through the window planner's methods (defer, take from the carry).
    It reads the pool, and leaves the epoch's counters to the epoch run: ``last_fit`` says what the
    last window's fit did. ``steps_done`` tells it the steps emitted so far (for its messages).
    """

    def __init__(self, exchange: Any, planner: WindowPlanner, pool: SamplePool, *, epoch: int, seed: int,
                 shuffle: bool, steps_done: Callable[[], int] = lambda: 0, whole_windows: bool = False,
                 pairing: Optional[Pairing] = None) -> None:
        self.exchange = exchange
        # global_batch_size: a window is an optimizer step, emitted whole (nothing deferred to a later one)
        self.whole_windows = whole_windows
        self.planner, self.pool = planner, pool
        self.epoch, self.seed, self.shuffle = epoch, seed, shuffle
        self._steps_done = steps_done
        self.local_only = exchange is None
        self.all_done = False
        self.last_fit = FitCounts()
        self.headers = HeaderMessage(agreed_values(planner.cfg, shuffle))  # the header's layout, what it said
        self.due = DueExchanges()  # steps not yet confirmed (made) on this rank, the next exchange's shape
        self.side = side_needed(planner.cfg)  # the planner prices (or caps) patches, supervised tokens
        # how ranks pair their groups (balance): by the criterion's price in a window where it is ready on every
        # rank (a flag in the header), else by the planner's cost
        self.pairing = pairing if pairing is not None else TokenPairing()

    # ---- state (odb.resume) ------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Whether every rank is done, and whether this rank goes on alone: constant keys."""
        return {"all_done": self.all_done, "local_only": self.local_only}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.all_done = bool(state["all_done"])
        self.local_only = bool(state["local_only"]) or self.exchange is None

    def expect_confirmations(self, steps: int) -> None:
        """A resumed run holds ``steps`` exchanged steps that it makes and confirms from now on."""
        self.due.unconfirmed = steps

    @property
    def has_peers(self) -> bool:
        """Whether a data-parallel replica spans several processes (odb.comm.replicas): they plan alike."""
        return self.exchange is not None and self.exchange.processes > self.exchange.world_size

    @property
    def agreed_plan(self) -> Any:
        """agree() of every rank's budget plan proposal at the last header (None: this rank sent none)."""
        return self.headers.agreed_plan

    # ---- alignment ---------------------------------------------------------------------
    def cost(self, group: np.ndarray) -> int:
        """The planner's cost of a group (``CostModel.group_cost``)."""
        return self.planner.cost.group_cost(self.pool.lengths(group), self.pool.side(group, self.side))

    @property
    def prices_ready(self) -> bool:
        """Whether the pairing criterion prices this window on every rank (balance="time": each rank's
        step-time model predicts), as the last header said."""
        return self.headers.ready_all and self.pairing.prices

    def pair_cost(self, group: np.ndarray) -> int:
        """What ranks compare to pair groups of similar cost: the pairing criterion's price where every rank's
        criterion is ready this window (balance="time": predicted microseconds), else ``cost``."""
        if self.prices_ready:
            price = self.pairing.price(self.planner.cost.pad(self.pool.lengths(group)), self.pool.side(group))
            if price is not None:
                return price
        return self.cost(group)

    def local(self, groups: List[np.ndarray]) -> List[Step]:
        """Every group is a step of its own, with local figures as global ones."""
        plans = local_steps([self.pool.loss_tokens(g) for g in groups], [len(g) for g in groups])
        return [(s, groups[s.group]) for s in plans]

    def align(self, groups: List[np.ndarray], planned_final: bool, window_index: int,
              proposal: Optional[np.ndarray] = None) -> List[Step]:
        """This window's steps; sets ``all_done`` once no rank has anything left. ``proposal``: this rank's
        encoded budget plan for the next window (sent with the header; ``agreed_plan`` then holds every
        rank's agreement)."""
        self.last_fit = FitCounts()
        if self.local_only:
            self.all_done = planned_final
            return self.local(groups)
        ex, cfg = self.exchange, self.planner.cfg
        where = f"epoch {self.epoch}, window {window_index}"
        header = self.header([len(groups), self._must_emit(groups), int(planned_final), self.seed], where, proposal)
        window = decide_window(header[:, 0], header[:, 1], header[:, 2].astype(bool), cfg.join, self.whole_windows)
        if window.go_local:
            self.local_only = True
            self.all_done = planned_final
            return self.local(groups)
        n_steps = window.steps
        self.due.body = (n_steps, BODY_FIELDS) if n_steps else None
        fitted = self._fit(groups, n_steps, planned_final)
        probe = cfg.probe_worst_case and window_index == 1
        stats = np.array([[self.pair_cost(g), len(g), self.pool.loss_tokens(g), self.pool.longest(g) if probe else 0]
                          if g is not None else [0] * BODY_FIELDS for g in fitted],
                         dtype=np.int64).reshape(n_steps, BODY_FIELDS)
        everyone, orders = self._ranked_bodies(stats, where, probe)
        ranked = [fitted[k] for k in orders[ex.rank].tolist()]
        self.due.body = None
        self.due.unconfirmed += n_steps
        order = shared_step_order(n_steps, int(header[0, 3]), self.epoch, window_index, self.shuffle)
        if probe and n_steps:  # every rank's batch with the longest samples runs first
            order = np.concatenate(([0], order[order != 0]))
        self.all_done = window.all_done
        slots = [k if ranked[k] is not None else None for k in range(n_steps)]
        return [(s, None if s.group is None else ranked[s.group])
                for s in global_steps(everyone, ex.rank, order, slots)]

    def _ranked_bodies(self, stats: np.ndarray, where: str, probe: bool) -> Tuple[np.ndarray, np.ndarray]:
        """Every replica's step summaries ((world, S, 3): cost, samples, loss tokens), each ranked by its cost (and
        its longest sample where ``probe``), and each replica's rank order of its groups. Every rank ranks every
        replica's groups from the gathered summaries (its first peer's costs): the peers of a replica, whose
        prices are their own (balance="time"), so rank their groups alike."""
        ex = self.exchange
        if not len(stats):
            return np.zeros((ex.world_size, 0, 3), dtype=np.int64), np.zeros((ex.world_size, 0), dtype=np.int64)
        rows = ex.all_gather(stats, where, every_process=True)
        rows = ex.replica_rows(rows, where, compare=lambda r: r[..., 1:])  # costs may be each process's prices
        orders = cost_rank_order(rows[..., 0], rows[..., 3] if probe else None)  # every replica's, in one sort
        return np.take_along_axis(rows[..., :3], orders[..., None], axis=1), orders

    def header(self, fields: List[int], where: str, proposal: Optional[np.ndarray] = None) -> np.ndarray:
        """Every rank's 4 header ``fields`` ((world, 4)), checking that the ranks plan under the same options;
        ``proposal``: this rank's encoded budget plan (``agreed_plan`` then holds every rank's agreement)."""
        header = self._exchange(fields, where, proposal)
        self.headers.agree(proposal is not None)
        return header

    def expect(self, shape: Optional[Tuple[int, ...]]) -> None:
        """The shape of the exchange every rank makes next, until the next header or confirmation (None: a
        header's): where ``announce`` joins them with a failure."""
        self.due.body = shape

    def steps_exchanged(self, steps: int) -> None:
        """``steps`` steps were agreed outside ``align`` (a global step plan): they are confirmed once made."""
        if self.due.confirms:
            self.due.unconfirmed += steps

    @property
    def confirm_every(self) -> int:
        """Batches to make before they are confirmed together (1: nothing to confirm, deliver at once)."""
        return 1 if self.local_only or not self.due.confirms else CONFIRM_STEPS

    def confirm(self, steps: int, where: str, digest: int = 0) -> None:
        """Tell every rank this rank made its batches of the last ``steps`` steps (and learn that they
        made theirs); ``digest`` (``check_peers``: odb.epoch.peer_check) is compared between the peers of
        each replica."""
        if self.local_only or self.due.unconfirmed <= 0:
            return
        self._exchange([digest, 0, 0, 0], where)
        self.due.unconfirmed -= steps

    @property
    def finished(self) -> bool:
        """No exchange of this epoch is left on any rank (so nobody would hear an announcement)."""
        due = self.due
        return self.local_only or (self.all_done and due.unconfirmed <= 0 and due.body is None)

    def announce(self, error: Optional[BaseException]) -> None:
        """Join the next exchange with this rank's failure (``error``) or stop (None), so every rank raises
        at once; nothing when no exchange is left or the exchange already failed."""
        if self.finished or not self.due.confirms:  # (not confirms: no exchange of this thread is left to meet at)
            return
        shape = self.due.body if self.due.body is not None else (self.headers.size,)
        self.exchange.announce(shape, f"epoch {self.epoch}, after step {self._steps_done()}", error)

    def _exchange(self, fields: List[int], where: str, plan: Optional[np.ndarray] = None) -> np.ndarray:
        """A header-sized message (``HeaderMessage``) of every rank; refuses ranks whose loaders plan under other
        options."""
        message = self.headers.message(fields, plan, ready=self.pairing.ready())
        # every process's message: the proposals and readiness of what each measures are agreed over all of them
        gathered = self.exchange.all_gather(message, where, every_process=True)
        try:
            fields = self.headers.read(gathered, self.exchange.process_rank)
        except ODBOptionMismatch:
            self.exchange.dead = True  # every rank raises this: nobody exchanges on this group again
            raise
        return self.exchange.replica_rows(fields, where)

    def _rebalance(self, groups: List[np.ndarray], n_steps: int) -> List[np.ndarray]:
        """This rank's last groups re-cut into n_steps similar ones (no tiny tail, no halving)."""
        ids = np.concatenate(groups)
        patches = self.pool.side(ids, self.side)
        parts = balanced_partition(self.pool.lengths(ids), ids, self.planner.cost, n_steps, patches)
        return [ids[p] for p in parts]

    def _must_emit(self, groups: List[np.ndarray]) -> int:
        """Groups this rank cannot defer: deferring more would grow its carry past a full window."""
        cfg, carried = self.planner.cfg, self.planner.carried_ids
        window_tokens = self.planner.window_tokens
        room_tokens = None if window_tokens is None else window_tokens - self.pool.real_tokens(carried)
        return must_emit([self.cost(g) for g in groups], [len(g) for g in groups],
                         [self.pool.real_tokens(g) for g in groups] if room_tokens is not None else [0] * len(groups),
                         cfg.buffer_size - len(carried), room_tokens)

    def _fit(self, groups: List[np.ndarray], n_steps: int, planned_final: bool) -> List[Optional[np.ndarray]]:
        """Exactly n_steps groups (odb.plan.ranks.fitting decides): defer the least costly to the carry; or
        re-cut the last window, take groups from the carry, split the largest, then add ghosts (None)."""
        trim = decide_trim([self.cost(g) for g in groups], n_steps, planned_final or self.whole_windows)
        for k in trim.defer.tolist():
            g = groups[k]
            self.planner.defer(g, self.pool.lengths(g), self.pool.side(g, self.side))
        out = [groups[k] for k in trim.keep.tolist()]
        if trim.rebalance:
            out = self._rebalance(out, n_steps)
        from_carry = self.planner.take_from_carry(n_steps - len(out))
        out.extend(from_carry)
        split = decide_splits([len(g) for g in out], n_steps)
        self.last_fit = FitCounts(len(trim.defer), len(from_carry), split.splits)
        return split.apply(out)
