"""The window layer: pools carried samples with each new window and plans the pool.

Pure bookkeeping over sample ids and lengths (no samples, no torch): the loader maps
ids back to samples; benchmarks and tests drive it with length arrays alone.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.costs.plan_costs import PlanCosts
from odb.plan.windows.planner import plan_window
from odb.plan.steps.step_cut import plan_step_share

if TYPE_CHECKING:  # plan/ is pure numpy: the config is only read, never imported at run time
    from odb.config import ODBConfig


# Default padded planning emits at 0.99 of a full batch; a window whose plan emits fewer than FEED_SHARE
# of its new samples adds the best carried runs that reach FEED_EFFICIENCY until it does (docs/algorithm.md).
FEED_SHARE, FEED_EFFICIENCY = 0.55, 0.95


def feed_runs(lengths: np.ndarray, ids: np.ndarray, cost: CostModel, patches: Optional[np.ndarray],
              samples: float) -> List[np.ndarray]:
    """Runs of these (carried) samples that reach ``FEED_EFFICIENCY`` of a full batch, best token
    efficiency first, until they hold at least ``samples`` samples or none is left: positions.

    Example:
        >>> [g.tolist() for g in feed_runs(np.array([[50], [48], [10]]), np.arange(3), CostModel((100,)), None, 1)]
        [[0, 1]]
    """
    plan = plan_window(lengths, ids, cost, final=False, pack_efficiency=FEED_EFFICIENCY, carry_limit=len(ids),
                       patches=patches)
    if not plan.groups:
        return []
    padded = cost.pad(lengths)
    quality = [float(lengths[g].sum()) / (len(g) * float(padded[g].max(axis=0).sum())) for g in plan.groups]
    out: List[np.ndarray] = []
    for k in np.argsort(-np.asarray(quality), kind="stable"):
        if samples <= 0:
            break
        out.append(plan.groups[k])
        samples -= len(plan.groups[k])
    return out


@dataclasses.dataclass
class PlannedWindow:
    """Batches planned from one pool, as arrays of sample ids, in planner order."""

    groups: List[np.ndarray]
    oversize: np.ndarray  # ids of samples that alone exceed the budget
    final: bool
    new_samples: int = 0  # samples the window added to the carry


class WindowPlanner:
    """Plans successive windows; keeps the carried samples between them.

    Example:
        >>> from odb.config import ODBConfig
        >>> wp = WindowPlanner(ODBConfig(token_budget=100, buffer_size=4))
        >>> out = wp.plan(np.arange(4), np.array([50, 50, 10, 10]), final=True)
        >>> [g.tolist() for g in out.groups]
        [[0, 1], [2, 3]]
    """

    def __init__(self, cfg: ODBConfig, costs: Optional[PlanCosts] = None) -> None:
        self.cfg = cfg  # the user's options; the prices move with ``set_costs``
        self.costs = costs if costs is not None else PlanCosts.of(cfg)
        self.cost = CostModel.from_config(cfg, self.costs)
        self._carry_ids = np.empty(0, dtype=np.int64)
        self._carry_len: Optional[np.ndarray] = None
        self._carry_patches: Optional[np.ndarray] = None
        self._seen = 0
        self._seen_tokens = 0
        self._emitted = 0

    def full_window_samples(self) -> int:
        """Samples in a full window, at the mean length seen so far (ramp windows are smaller).

        The carry may hold as many, so the ramp does not shrink the carry."""
        tokens = self.window_tokens
        if tokens is None or self._seen_tokens == 0:
            return self.cfg.buffer_size
        return int(min(self.cfg.buffer_size, -(-tokens * self._seen // self._seen_tokens)))

    @property
    def carried_ids(self) -> np.ndarray:
        return self._carry_ids

    def plan(self, ids: np.ndarray, lengths: np.ndarray, patches: Optional[np.ndarray] = None,
             final: bool = False, carry_limit: Optional[int] = None) -> PlannedWindow:
        """Pool the new samples with the carry and plan; keeps the new carry (at most ``carry_limit``
        samples; default: a full window at the mean length seen so far)."""
        ids = np.asarray(ids, dtype=np.int64)
        new_samples = len(ids)
        self._seen += len(ids)
        self._seen_tokens += int(np.asarray(lengths).sum())
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim == 1:
            lengths = lengths[:, None]
        if self._carry_len is not None and len(self._carry_ids):
            ids = np.concatenate((self._carry_ids, ids))
            lengths = np.concatenate((self._carry_len, lengths))
            if patches is not None:
                patches = np.concatenate((self._carry_patches, patches))
        if carry_limit is None:
            carry_limit = self.cfg.carry_limit(self.full_window_samples())
        if self._emitted == 0 and lengths.sum() >= self.cost.total_budget:
            # Nothing emitted yet and the pool holds a budget's worth: emit a batch however it packs, so
            # the first step does not wait for more windows (short samples rarely pack well this early).
            carry_limit = min(carry_limit, max(len(ids) - 1, 0))
        efficiency = self.cfg.emit_efficiency
        plan = plan_window(lengths, ids, self.cost, final=final, pack_efficiency=efficiency,
                           carry_limit=carry_limit, patches=patches)
        groups, carry = list(plan.groups), plan.carry
        short = FEED_SHARE * new_samples - sum(len(g) for g in groups)
        if (short > 0 and not final and len(carry) and self.cfg.pack_efficiency is None and not self.cost.packed
                and not self.cost.bucketed and efficiency > FEED_EFFICIENCY):
            # Small ramp-up pools rarely reach 0.99: the window would hold back most of what it read and
            # the loop would wait while the next window is read. Keep batches flowing with the best carried
            # runs that reach 0.95. Not with shape_buckets: their batches would not be full, and each partial
            # size is one more shape for a compiled model.
            sub_patches = None if patches is None else np.asarray(patches)[carry]
            extra = feed_runs(lengths[carry], ids[carry], self.cost, sub_patches, short)
            taken = np.zeros(len(carry), dtype=bool)
            for g in extra:
                taken[g] = True
            groups += [carry[g] for g in extra]
            carry = carry[~taken]
        self._carry_ids = ids[carry]
        self._carry_len = lengths[carry]
        self._carry_patches = None if patches is None else np.asarray(patches)[carry]
        self._emitted += len(groups)
        return PlannedWindow([ids[g] for g in groups], ids[plan.oversize], final, new_samples)

    def plan_step(self, ids: np.ndarray, lengths: np.ndarray, patches: Optional[np.ndarray] = None) -> PlannedWindow:
        """One optimizer step's samples (``global_batch_size``), all emitted, cut at the least cost with
        ``micro_batch_cost`` per micro-batch (default: a sixteenth of the budget): odb.plan.steps.step_cut.

        Example:
            >>> from odb.config import ODBConfig
            >>> wp = WindowPlanner(ODBConfig(token_budget=100, global_batch_size=6))
            >>> [g.tolist() for g in wp.plan_step(np.arange(6), np.array([50, 48, 12, 10, 10, 9])).groups]
            [[0, 1], [2, 3, 4, 5]]
        """
        ids = np.asarray(ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        plan = plan_step_share(lengths, ids, self.cost, self.step_overhead(), patches)
        self._seen += len(ids)
        self._seen_tokens += int(lengths.sum())
        self._emitted += len(plan.groups)
        return PlannedWindow([ids[g] for g in plan.groups], ids[plan.oversize], True, len(ids))

    def step_overhead(self) -> float:
        """The fixed cost of one micro-batch of an optimizer step: ``micro_batch_cost``, by default a sixteenth
        of the budget."""
        overhead = self.cfg.micro_batch_cost
        return float(self.cost.total_budget / 16 if overhead is None else overhead)

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

    def set_costs(self, costs: PlanCosts) -> None:
        """Plan the next windows under these prices (a window budget's: odb.epoch.budget)."""
        if costs != self.costs:
            self.costs = costs
            self.cost = CostModel.from_config(self.cfg, costs)

    @property
    def window_tokens(self) -> Optional[int]:
        """Real tokens at which a window closes under the current budget (None: counted in samples)."""
        if self.cfg.window_budgets is None:
            return None
        return self.cfg.window_budgets * self.costs.total

    def take_from_carry(self, count: int) -> List[np.ndarray]:
        """Up to ``count`` batches cut greedily from the carry, costliest (fullest) first; removed from it."""
        if count <= 0 or self._carry_len is None or not len(self._carry_ids):
            return []
        plan = plan_window(self._carry_len, self._carry_ids, self.cost, final=True, patches=self._carry_patches)
        side = self._carry_patches
        costs = [self.cost.batch_cost(self.cost.pad(self._carry_len[g]), None if side is None else side[g])
                 for g in plan.groups]
        chosen = [plan.groups[k] for k in np.argsort(-np.asarray(costs), kind="stable")[:count]]
        keep = np.ones(len(self._carry_ids), dtype=bool)
        for g in chosen:
            keep[g] = False
        out = [self._carry_ids[g] for g in chosen]
        self._carry_ids, self._carry_len = self._carry_ids[keep], self._carry_len[keep]
        if self._carry_patches is not None:
            self._carry_patches = self._carry_patches[keep]
        return out

    def state_dict(self) -> Dict[str, Any]:
        """What the planner has seen and done (``counts``: samples, real tokens, batches emitted) and the
        ids it carries (``carry``), as plain data: part of the resume state (the carried samples' lengths
        are measured again when they are read back).

        Example:
            >>> from odb.config import ODBConfig
            >>> wp = WindowPlanner(ODBConfig(token_budget=100, buffer_size=4))
            >>> _ = wp.plan(np.arange(3), np.array([50, 50, 10]))
            >>> wp.state_dict()
            {'counts': [3, 110, 1], 'carry': [2]}
        """
        return {"counts": [self._seen, self._seen_tokens, self._emitted], "carry": self._carry_ids.tolist()}

    def load_state_dict(self, state: Dict[str, Any], lengths: Optional[np.ndarray] = None,
                        patches: Optional[np.ndarray] = None) -> None:
        """Continue from ``state_dict``'s output; ``lengths`` (and ``patches``, when a patch cap is set) are
        those of the carried samples, in ``state["carry"]``'s order."""
        counters = state["counts"]
        self._seen, self._seen_tokens = int(counters[0]), int(counters[1])
        # States saved before the emitted count was kept: any sample seen means a batch was emitted.
        self._emitted = int(counters[2]) if len(counters) > 2 else int(self._seen > 0)
        carry = np.asarray(state["carry"], dtype=np.int64)
        if len(carry):
            self.restore_carry(carry, lengths, patches)

    def restore_carry(self, ids: np.ndarray, lengths: np.ndarray, patches: Optional[np.ndarray]) -> None:
        """Set the carried samples (used by resume)."""
        self._carry_ids = np.asarray(ids, dtype=np.int64)
        lengths = np.asarray(lengths, dtype=np.int64)
        self._carry_len = lengths[:, None] if lengths.ndim == 1 else lengths
        self._carry_patches = None if patches is None else np.asarray(patches)


def window_limits(cfg: ODBConfig, index: int, remaining: Optional[int] = None,
                  carried: int = 0, window_tokens: Any = "config") -> Tuple[int, Optional[int]]:
    """(most samples, real tokens at which it closes) of an epoch's window number ``index``.

    Windows ramp up from ``first_window_size`` samples (x1.5 per window) so the first batch
    does not wait for a full window, and each ramp window is read while its predecessor
    trains (a steeper ramp, such as doubling, makes the loop wait whenever a step costs less
    than twice its data); a full window holds ``window_budgets`` budgets' worth of
    tokens, capped at ``buffer_size`` samples. With ``remaining`` (samples of the epoch
    not yet in a window, when the sampler's length is known) they ramp down again: a
    window takes at most half of what remains, so the last window, whose batches can only
    train once the data has ended, is small. A ramp-down window still takes half as many
    samples as the planner carries (``carried``), so the carry, which every window plans
    again, is not re-planned many times over for a few new samples. ``window_tokens``: the
    planner's (``WindowPlanner.window_tokens``, under the window's budget); default ``cfg``'s.

    Example:
        >>> from odb.config import ODBConfig
        >>> cfg = ODBConfig(token_budget=100, window_budgets=4, buffer_size=1000, first_window_size=8)
        >>> [window_limits(cfg, k) for k in (0, 1, 2, 20)]
        [(8, 400), (12, 400), (18, 400), (1000, 400)]
        >>> window_limits(cfg, 10, remaining=300), window_limits(cfg, 10, remaining=300, carried=500)
        ((150, 400), (250, 400))
    """
    samples = cfg.buffer_size if cfg.probe_worst_case else cfg.first_window_size
    for _ in range(index):
        if samples >= cfg.buffer_size:
            break
        samples = -(-samples * 3 // 2)  # x1.5: a window reads little more than its predecessor trains on
    samples = min(samples, cfg.buffer_size)
    if remaining is not None:
        samples = min(samples, max(cfg.first_window_size, -(-remaining // 2), carried // 2))
    return samples, cfg.window_tokens if window_tokens == "config" else window_tokens


def window_cut(token_counts: np.ndarray, max_samples: int, max_tokens: Optional[int]) -> int:
    """How many of the next samples (real tokens ``token_counts``, arrival order) the window takes.

    The window closes at ``max_samples`` or with the sample that brings it to ``max_tokens``.

    Example:
        >>> window_cut(np.array([5, 5, 5, 5]), 10, 12)
        3
    """
    n = min(len(token_counts), max_samples)
    if max_tokens is None:
        return n
    reached = np.flatnonzero(np.cumsum(token_counts[:n]) >= max_tokens)
    return int(reached[0]) + 1 if len(reached) else n


def plan_stream(lengths: np.ndarray, cfg: ODBConfig,
                patches: Optional[np.ndarray] = None) -> Iterator[PlannedWindow]:
    """Plan a whole stream of lengths (in arrival order) window by window, as the loader does.

    Sample ids are arrival positions. Used by benchmarks, tests and the step estimate.
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    tokens = lengths.reshape(n, -1).sum(axis=1) if n else np.zeros(0, dtype=np.int64)
    wp = WindowPlanner(cfg)
    start, k = 0, 0
    while start < n or (n == 0 and k == 0):
        stop = start + window_cut(tokens[start:], *window_limits(cfg, k, n - start, len(wp.carried_ids)))
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
