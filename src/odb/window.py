"""The window layer: pools carried samples with each new window and plans the pool.

Pure bookkeeping over sample ids and lengths (no samples, no torch): the loader maps
ids back to samples; benchmarks and tests drive it with length arrays alone.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Iterator, List, Optional, Tuple

import numpy as np

from .config import ODBConfig
from .cost import CostModel
from .planner import plan_window


@dataclasses.dataclass
class PlannedWindow:
    """Batches planned from one pool, as arrays of sample ids, in planner order."""

    groups: List[np.ndarray]
    oversize: np.ndarray  # ids of samples that alone exceed the budget
    final: bool


class WindowPlanner:
    """Plans successive windows; keeps the carried samples between them.

    Example:
        >>> wp = WindowPlanner(ODBConfig(token_budget=100, buffer_size=4))
        >>> out = wp.plan(np.arange(4), np.array([50, 50, 10, 10]), final=True)
        >>> [g.tolist() for g in out.groups]
        [[0, 1], [2, 3]]
    """

    def __init__(self, cfg: ODBConfig) -> None:
        self.cfg = cfg
        self.cost = CostModel.from_config(cfg)
        self._carry_ids = np.empty(0, dtype=np.int64)
        self._carry_len: Optional[np.ndarray] = None
        self._carry_patches: Optional[np.ndarray] = None

    @property
    def carried_ids(self) -> np.ndarray:
        return self._carry_ids

    def plan(self, ids: np.ndarray, lengths: np.ndarray, patches: Optional[np.ndarray] = None,
             final: bool = False) -> PlannedWindow:
        """Pool the new samples with the carry and plan; keeps the new carry."""
        ids = np.asarray(ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim == 1:
            lengths = lengths[:, None]
        if self._carry_len is not None and len(self._carry_ids):
            ids = np.concatenate((self._carry_ids, ids))
            lengths = np.concatenate((self._carry_len, lengths))
            if patches is not None:
                patches = np.concatenate((self._carry_patches, patches))
        plan = plan_window(lengths, ids, self.cost, final=final, pack_efficiency=self.cfg.pack_efficiency,
                           carry_limit=self.cfg.carry_limit, patches=patches)
        self._carry_ids = ids[plan.carry]
        self._carry_len = lengths[plan.carry]
        self._carry_patches = None if patches is None else np.asarray(patches)[plan.carry]
        return PlannedWindow([ids[g] for g in plan.groups], ids[plan.oversize], final)

    def defer(self, ids: np.ndarray, lengths: np.ndarray, patches: Optional[np.ndarray]) -> None:
        """Put planned samples back into the carry (a rank ran fewer steps than it planned)."""
        lengths = np.asarray(lengths, dtype=np.int64).reshape(len(ids), -1)
        if self._carry_len is None or not len(self._carry_ids):
            self.restore_carry(ids, lengths, patches)
            return
        self._carry_ids = np.concatenate((self._carry_ids, np.asarray(ids, dtype=np.int64)))
        self._carry_len = np.concatenate((self._carry_len, lengths))
        if patches is not None:
            self._carry_patches = np.concatenate((self._carry_patches, patches))

    def set_config(self, cfg: ODBConfig) -> None:
        """Plan the next windows under another config (e.g. a new token budget)."""
        self.cfg = cfg
        self.cost = CostModel.from_config(cfg)

    def take_from_carry(self, count: int) -> List[np.ndarray]:
        """Up to ``count`` batches cut greedily from the carry, costliest (fullest) first; removed from it."""
        if count <= 0 or self._carry_len is None or not len(self._carry_ids):
            return []
        plan = plan_window(self._carry_len, self._carry_ids, self.cost, final=True, patches=self._carry_patches)
        costs = [self.cost.batch_cost(self.cost.pad(self._carry_len[g])) for g in plan.groups]
        chosen = [plan.groups[k] for k in np.argsort(-np.asarray(costs), kind="stable")[:count]]
        keep = np.ones(len(self._carry_ids), dtype=bool)
        for g in chosen:
            keep[g] = False
        out = [self._carry_ids[g] for g in chosen]
        self._carry_ids, self._carry_len = self._carry_ids[keep], self._carry_len[keep]
        if self._carry_patches is not None:
            self._carry_patches = self._carry_patches[keep]
        return out

    def restore_carry(self, ids: np.ndarray, lengths: np.ndarray, patches: Optional[np.ndarray]) -> None:
        """Set the carried samples (used by resume)."""
        self._carry_ids = np.asarray(ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        self._carry_len = lengths[:, None] if lengths.ndim == 1 else lengths
        self._carry_patches = None if patches is None else np.asarray(patches)


def plan_stream(lengths: np.ndarray, cfg: ODBConfig,
                patches: Optional[np.ndarray] = None) -> Iterator[PlannedWindow]:
    """Plan a whole stream of lengths (in arrival order) window by window.

    Sample ids are arrival positions. Used by benchmarks and tests.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    wp = WindowPlanner(cfg)
    start, k = 0, 0
    while start < n or (n == 0 and k == 0):
        size = min(cfg.buffer_size, cfg.first_window_size << min(k, 30))
        stop = min(start + size, n)
        sl = slice(start, stop)
        yield wp.plan(np.arange(start, stop), lengths[sl], None if patches is None else patches[sl],
                      final=stop >= n)
        start, k = stop, k + 1


def oracle_groups(lengths: np.ndarray, cfg: ODBConfig, patches: Optional[np.ndarray] = None) -> List[np.ndarray]:
    """The offline oracle: all lengths known, sorted descending, cut greedily."""
    lengths = np.asarray(lengths, dtype=np.int64)
    plan = plan_window(lengths, np.arange(len(lengths)), CostModel.from_config(cfg), final=True, patches=patches)
    return plan.groups


def flatten(windows: Iterable[PlannedWindow]) -> Tuple[List[np.ndarray], np.ndarray]:
    groups: List[np.ndarray] = []
    over: List[np.ndarray] = []
    for w in windows:
        groups.extend(w.groups)
        over.append(w.oversize)
    return groups, (np.concatenate(over) if over else np.empty(0, dtype=np.int64))
