"""How one rank fits its planned groups to the steps all ranks agreed on.

A mixin of EpochRun (it reads the run's sample metadata and planner): exchange the
window header, decide the step count (pure, odb.align), then defer, draw from the
carry, re-balance the last window, split, or add ghosts; exchange per-step summaries
and order the steps identically on every rank.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import numpy as np

from .align import StepPlan, decide_steps, global_steps, shared_step_order
from .planner import balanced_partition


class RankFitting:
    """The distributed half of EpochRun (engine.py sets the attributes it uses)."""

    def _align_ranks(self, groups: List[np.ndarray]) -> List[Tuple[StepPlan, Optional[np.ndarray]]]:
        ex = self._exchange
        where = f"epoch {self.epoch}, window {self._window_index}"
        header = ex.all_gather(np.array([len(groups), self._must_emit(groups), int(self._planned_final),
                                         self.seed]), where)
        exhausted = header[:, 2].astype(bool)
        if not self.cfg.join and exhausted.any():
            # join=False: from the first window where a rank's data ends, every rank
            # emits its own groups and stops when they end (the user wraps the model in Join).
            self._local_only = True
            self._all_done = self._planned_final
            return self._local_steps(groups)
        n_steps = decide_steps(header[:, 0], header[:, 1], exhausted)
        fitted = self._fit(groups, n_steps)
        probe = self.cfg.probe_worst_case and self._window_index == 1
        keys = [(self._longest(g) if probe else 0, self._cost(g)) if g is not None else (0, 0) for g in fitted]
        ranked = [fitted[k] for k in sorted(range(len(fitted)), key=lambda k: (-keys[k][0], -keys[k][1]))]
        stats = np.array([[self._cost(g), len(g), self._loss([g])[0]] if g is not None else [0, 0, 0]
                          for g in ranked], dtype=np.int64).reshape(n_steps, 3)
        everyone = ex.all_gather(stats, where) if n_steps else np.zeros((self.world_size, 0, 3), dtype=np.int64)
        order = shared_step_order(n_steps, int(header[0, 3]), self.epoch, self._window_index, self.shuffle)
        if probe and n_steps:  # every rank's batch with the longest samples runs first
            order = np.concatenate(([0], order[order != 0]))
        self._all_done = bool(exhausted.all())
        slots = [k if ranked[k] is not None else None for k in range(n_steps)]
        return [(s, None if s.group is None else ranked[s.group])
                for s in global_steps(everyone, ex.rank, order, slots)]

    def _rebalance(self, groups: List[np.ndarray], n_steps: int) -> List[Optional[np.ndarray]]:
        """This rank's last groups re-cut into n_steps similar ones (no tiny tail, no halving)."""
        ids = np.concatenate(groups)
        metas = [self._meta[int(i)] for i in ids]
        patches = np.array([m.patches for m in metas]) if self.cfg.image_patches_key else None
        parts = balanced_partition(np.array([m.lengths for m in metas]), ids, self.planner.cost, n_steps, patches)
        return [ids[p] for p in parts]

    def _must_emit(self, groups: List[np.ndarray]) -> int:
        """Groups this rank cannot defer: deferring more would grow its pool past buffer_size."""
        room = self.cfg.buffer_size - len(self.planner.carried_ids)
        must = len(groups)
        for g in sorted(groups, key=self._cost):
            if len(g) > room:
                break
            room -= len(g)
            must -= 1
        return must

    def _fit(self, groups: List[np.ndarray], n_steps: int) -> List[Optional[np.ndarray]]:
        """Exactly n_steps groups: defer the least costly; or take groups from the carry, then split
        the largest, then add ghosts (None)."""
        out: List[Optional[np.ndarray]] = list(groups)
        if len(out) > n_steps:
            by_cost = sorted(range(len(out)), key=lambda k: self._cost(out[k]))
            drop = set(by_cost[:len(out) - n_steps])
            for k in drop:
                self._defer(out[k])
            self.stats.deferred_groups += len(drop)
            out = [g for k, g in enumerate(out) if k not in drop]
        if self._planned_final and n_steps > len(out) and out:
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
