"""How one rank fits its planned groups to the steps all ranks agreed on.

Exchange the window header, decide the step count (pure, odb.plan.align), then defer, draw
from the carry, re-balance the last window, split, or add ghosts; exchange per-step
summaries and order the steps identically on every rank. Works on the window planner
(carry) and the sample pool (lengths, loss tokens) it is given.

Steps are confirmed once made, ``CONFIRM_STEPS`` at a time (``confirm``), before any of
them reaches the training loop, so a rank whose batch failed stops every rank at the same
step; ``announce`` joins the next exchange with a failure or a stop. The header and the
confirmation have the same size (status, 4 header fields, the plan options'
fingerprint), so a rank that fails anywhere but between a header and its summaries knows
the shape the others expect.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import numpy as np

from odb.comm.agreement import agreed_values, check_agreement, fingerprint
from odb.plan.align import StepPlan, decide_steps, global_steps, local_steps, shared_step_order
from odb.comm.dist import ODBOptionMismatch
from odb.plan.planner import balanced_partition
from odb.epoch.pool import SamplePool
from odb.epoch.stats import EpochStats
from odb.plan.window import WindowPlanner

Step = Tuple[StepPlan, Optional[np.ndarray]]
CONFIRM_STEPS = 4  # steps confirmed by one exchange (the same on every rank: it shapes the protocol)


class RankAligner:
    """One rank's side of the per-window alignment (``exchange`` is None on a single process)."""

    def __init__(self, exchange: Any, planner: WindowPlanner, pool: SamplePool, stats: EpochStats, *,
                 epoch: int, seed: int, shuffle: bool) -> None:
        self.exchange = exchange
        self.planner, self.pool, self.stats = planner, pool, stats
        self.epoch, self.seed, self.shuffle = epoch, seed, shuffle
        self.local_only = exchange is None
        self.all_done = False
        self.unconfirmed = 0  # exchanged steps not yet confirmed (made) on this rank
        self._values = agreed_values(planner.cfg, shuffle)
        self._fingerprint = fingerprint(self._values)
        self._body: Optional[Tuple[int, int]] = None  # shape of the summaries due after a header

    def cost(self, group: np.ndarray) -> int:
        return self.pool.cost(group, self.planner.cost)

    def local(self, groups: List[np.ndarray]) -> List[Step]:
        """Every group is a step of its own, with local figures as global ones."""
        plans = local_steps([self.pool.loss_tokens(g) for g in groups], [len(g) for g in groups])
        return [(s, groups[s.group]) for s in plans]

    def align(self, groups: List[np.ndarray], planned_final: bool, window_index: int) -> List[Step]:
        """This window's steps; sets ``all_done`` once no rank has anything left."""
        if self.local_only:
            self.all_done = planned_final
            return self.local(groups)
        ex, cfg = self.exchange, self.planner.cfg
        where = f"epoch {self.epoch}, window {window_index}"
        header = self._exchange([len(groups), self._must_emit(groups), int(planned_final), self.seed], where)
        exhausted = header[:, 2].astype(bool)
        if not cfg.join and exhausted.any():
            # join=False: from the first window where a rank's data ends, every rank
            # emits its own groups and stops when they end (the user wraps the model in Join).
            self.local_only = True
            self.all_done = planned_final
            return self.local(groups)
        n_steps = decide_steps(header[:, 0], header[:, 1], exhausted)
        self._body = (n_steps, 3) if n_steps else None
        fitted = self._fit(groups, n_steps, planned_final)
        probe = cfg.probe_worst_case and window_index == 1
        keys = [(self.pool.longest(g) if probe else 0, self.cost(g)) if g is not None else (0, 0) for g in fitted]
        ranked = [fitted[k] for k in sorted(range(len(fitted)), key=lambda k: (-keys[k][0], -keys[k][1]))]
        stats = np.array([[self.cost(g), len(g), self.pool.loss_tokens(g)] if g is not None else [0, 0, 0]
                          for g in ranked], dtype=np.int64).reshape(n_steps, 3)
        everyone = ex.all_gather(stats, where) if n_steps else np.zeros((ex.world_size, 0, 3), dtype=np.int64)
        self._body = None
        self.unconfirmed += n_steps
        order = shared_step_order(n_steps, int(header[0, 3]), self.epoch, window_index, self.shuffle)
        if probe and n_steps:  # every rank's batch with the longest samples runs first
            order = np.concatenate(([0], order[order != 0]))
        self.all_done = bool(exhausted.all())
        slots = [k if ranked[k] is not None else None for k in range(n_steps)]
        return [(s, None if s.group is None else ranked[s.group])
                for s in global_steps(everyone, ex.rank, order, slots)]

    @property
    def confirm_every(self) -> int:
        """Batches to make before they are confirmed together (1: nothing to confirm, deliver at once)."""
        return 1 if self.local_only else CONFIRM_STEPS

    def confirm(self, steps: int, where: str) -> None:
        """Tell every rank this rank made its batches of the last ``steps`` steps (and learn that they
        made theirs)."""
        if self.local_only or self.unconfirmed <= 0:
            return
        self._exchange([0, 0, 0, 0], where)
        self.unconfirmed -= steps

    @property
    def finished(self) -> bool:
        """No exchange of this epoch is left on any rank (so nobody would hear an announcement)."""
        return self.local_only or (self.all_done and self.unconfirmed <= 0 and self._body is None)

    def announce(self, error: Optional[BaseException]) -> None:
        """Join the next exchange with this rank's failure (``error``) or stop (None), so every rank raises
        at once; nothing when no exchange is left or the exchange already failed."""
        announce = getattr(self.exchange, "announce", None)  # test stand-ins of the exchange may not announce
        if announce is None or self.finished:
            return
        shape = self._body if self._body is not None else (4 + len(self._fingerprint),)
        announce(shape, f"epoch {self.epoch}, after step {self.stats.steps}", error)

    def _exchange(self, fields: List[int], where: str) -> np.ndarray:
        """A header-sized message (4 fields and the options' fingerprint) of every rank; refuses ranks
        whose loaders plan under other options."""
        message = np.concatenate((np.asarray(fields, dtype=np.int64), self._fingerprint))
        gathered = self.exchange.all_gather(message, where)
        try:
            check_agreement(gathered[:, 4:], self._values, self.exchange.rank)
        except ODBOptionMismatch:
            self.exchange.dead = True  # every rank raises this: nobody exchanges on this group again
            raise
        return gathered[:, :4]

    def _rebalance(self, groups: List[np.ndarray], n_steps: int) -> List[Optional[np.ndarray]]:
        """This rank's last groups re-cut into n_steps similar ones (no tiny tail, no halving)."""
        ids = np.concatenate(groups)
        patches = self.pool.patches(ids) if self.planner.cfg.image_patches_key else None
        parts = balanced_partition(self.pool.lengths(ids), ids, self.planner.cost, n_steps, patches)
        return [ids[p] for p in parts]

    def _must_emit(self, groups: List[np.ndarray]) -> int:
        """Groups this rank cannot defer: deferring more would grow its carry past a full window."""
        cfg = self.planner.cfg
        carried = self.planner.carried_ids
        room = cfg.buffer_size - len(carried)
        window_tokens = cfg.window_tokens
        room_tokens = None if window_tokens is None else window_tokens - self.pool.real_tokens(carried)
        must = len(groups)
        for g in sorted(groups, key=self.cost):
            tokens = self.pool.real_tokens(g) if room_tokens is not None else 0
            if len(g) > room or (room_tokens is not None and tokens > room_tokens):
                break
            room -= len(g)
            if room_tokens is not None:
                room_tokens -= tokens
            must -= 1
        return must

    def _defer(self, group: np.ndarray) -> None:
        patches = self.pool.patches(group) if self.planner.cfg.image_patches_key else None
        self.planner.defer(group, self.pool.lengths(group), patches)

    def _fit(self, groups: List[np.ndarray], n_steps: int, planned_final: bool) -> List[Optional[np.ndarray]]:
        """Exactly n_steps groups: defer the least costly; or take groups from the carry, then split
        the largest, then add ghosts (None)."""
        out: List[Optional[np.ndarray]] = list(groups)
        if len(out) > n_steps:
            by_cost = sorted(range(len(out)), key=lambda k: self.cost(out[k]))
            drop = set(by_cost[:len(out) - n_steps])
            for k in drop:
                self._defer(out[k])
            self.stats.deferred_groups += len(drop)
            out = [g for k, g in enumerate(out) if k not in drop]
        if planned_final and n_steps > len(out) and out:
            out = self._rebalance(out, n_steps)
        from_carry = self.planner.take_from_carry(n_steps - len(out))
        out.extend(from_carry)
        self.stats.carry_groups += len(from_carry)
        while len(out) < n_steps:
            k = max((j for j, g in enumerate(out) if g is not None), key=lambda j: len(out[j]), default=None)
            if k is None or len(out[k]) < 2:
                out.extend([None] * (n_steps - len(out)))  # nothing left to split: the rest are ghosts
                break
            g = out.pop(k)  # planner order: longest first, so both halves stay within budget
            out.extend([g[:len(g) // 2 + len(g) % 2], g[len(g) // 2 + len(g) % 2:]])
            self.stats.split_groups += 1
        return out
