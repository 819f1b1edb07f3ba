"""How an epoch's windows are read and planned: one strategy per way, behind one interface (``Windows``).

``EpochRun`` reads each window's records through its strategy's ``read``, holds them, then asks ``plan``
for the window's steps; ``micro_steps`` says how many micro-batches make an optimizer step. The strategies:

* ``BudgetWindows``: windows filled to the window limits (the ramp up from ``first_window_size``, the
  window's tokens, ``buffer_size``; odb.plan.windows.window.window_limits), planned by the window planner with its
  carry; ``gradient_accumulation_steps`` micro-batches make an optimizer step; at the end ``drop_last``
  drops the last window's groups that fill less than half a batch.
* ``StepWindows`` (``global_batch_size``): a window is exactly the next optimizer step's samples on this
  rank (fewer at the end), planned whole (odb.plan.steps.step_cut); all of a window's steps make one optimizer
  step; at the end ``drop_last`` drops a partial last step, or its part past the user's whole batches
  (odb.epoch.drop_last).
* ``GlobalStepWindows`` (``global_batch_size`` with ``step_plan="global"`` on several ranks): the same
  windows, each step planned across ranks (odb.epoch.global_step), whose drop_last applies it to the
  step of every rank; a rank that goes on alone plans as ``StepWindows``.

``WindowGroups`` is what the per-rank strategies share: a window's samples measured, planned groups with
the oversize policy applied, ordered, and aligned with the other ranks' (odb.epoch.ranks.RankAligner).
``window_strategy`` picks the strategy of an epoch.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, List, Optional, Protocol, Set, Tuple

import numpy as np

from odb.config import ODBConfig
from odb.data.source import SampleSource
from odb.epoch.budget import WindowBudget
from odb.epoch.composer import StepComposer
from odb.epoch.drop_last import DropLast
from odb.epoch.global_step import GlobalStep
from odb.epoch.pool import SamplePool
from odb.epoch.ranks import RankAligner, Step
from odb.epoch.stats import EpochStats
from odb.plan.costs.buckets import oversize_message
from odb.plan.windows.window import PlannedWindow, WindowPlanner, window_limits

ONE_LENGTH_MIN = 32  # samples of one length in a first window before odb says there is nothing to group

Record = Tuple[int, int, Any, Any]  # (position, dataset index, sample, meta), as odb.data.source hands them
Cut = Callable[[List[int], bool], List[np.ndarray]]  # (a window's positions, final) -> its ordered groups


class Windows(Protocol):
    """How an epoch's windows are read and planned (what ``EpochRun`` calls)."""

    @property
    def micro_steps(self) -> Optional[int]:
        """Micro-batches of one optimizer step (None: all the steps of one window)."""

    @property
    def fill_warning(self) -> bool:
        """Whether batches that fill little of the token budget say something of the data (a step's samples
        set the fill of step windows)."""

    def read(self, source: SampleSource, arrived: int) -> Tuple[List[Record], List[int], bool]:
        """The records read from ``source`` now (``arrived``: samples read so far this epoch), the positions
        of the next window's samples (the run holds both), and whether the data has ended with the window."""

    def plan(self, ids: List[int], *, fresh: bool, final: bool, window_index: int, alone: bool) -> List[Step]:
        """The steps of the window of positions ``ids`` (``fresh``: read now, rather than the end of the data
        again; ``final``: this rank's data has ended; ``alone``: no other rank to align with)."""


class WindowGroups:
    """A rank's window as planned groups, then steps aligned with the other ranks: what ``BudgetWindows``
    and ``StepWindows`` share. It reads the pool, prices through the planner and ``budget`` (the oversize
    policy, auto's cap), counts in ``stats``, warns once per loader through ``notices``, and orders groups
    by (``seed``, ``epoch``, window) when ``shuffle``."""

    def __init__(self, cfg: ODBConfig, planner: WindowPlanner, pool: SamplePool, aligner: RankAligner,
                 stats: EpochStats, budget: WindowBudget, *, notices: Set[str], rank: int, epoch: int, seed: int,
                 shuffle: bool) -> None:
        self.cfg, self.planner, self.pool, self.aligner, self.stats, self.budget = \
            cfg, planner, pool, aligner, stats, budget
        self.notices, self.rank = notices, rank
        self.epoch, self.seed, self.shuffle = epoch, seed, shuffle

    def steps(self, cut: Cut, ids: List[int], *, fresh: bool, final: bool, window_index: int,
              alone: bool) -> List[Step]:
        """The window's groups (``cut`` of its positions; after the data ended, of the groups deferred by the
        alignment), aligned with the other ranks' into steps."""
        groups: List[np.ndarray] = []
        if fresh:
            groups = cut(ids, final)
        elif len(self.planner.carried_ids):  # groups deferred by the alignment after the data ended
            groups = cut([], True)
        aligner, stats = self.aligner, self.stats
        steps = aligner.align(groups, final, window_index, None if alone else self.budget.proposal())
        fit = aligner.last_fit
        stats.deferred_groups += fit.deferred
        stats.carry_groups += fit.from_carry
        stats.split_groups += fit.split
        return steps

    def measure(self, ids: List[int]) -> Tuple[np.ndarray, Optional[np.ndarray]]:
        """The lengths of ``ids`` and their image patches and supervised tokens (when they count); refuses a
        sample no batch can hold, and warns when the epoch's first window has one length."""
        patches = self.pool.side(ids, self.aligner.side)
        lengths = self.pool.lengths(ids)
        if len(lengths) and self.cfg.oversize != "skip":
            self.budget.check_length(int(lengths.sum(axis=1).max()))  # refuses what no batch can hold (auto's cap)
        if self.stats.windows == 0 and self.rank == 0:
            self._note_one_length(lengths)
        return lengths, patches

    @property
    def probe_window(self) -> bool:
        """Whether the next window is the probe's: it emits all it holds (its longest samples must not wait in
        the carry for a fuller batch)."""
        return bool(self.cfg.probe_worst_case and self.stats.windows == 0)

    def drop(self, ids: Any) -> None:
        """Forget ``ids``: drop_last dropped them."""
        self.stats.dropped_samples += len(ids)
        self.pool.forget(ids)

    def groups(self, planned: PlannedWindow) -> List[np.ndarray]:
        """A planned window's groups, with its samples over the budget as the oversize policy says."""
        self.stats.windows += 1
        groups = list(planned.groups)
        for sid in planned.oversize.tolist():
            groups.extend(self._oversize(sid))
        return groups

    def order(self, groups: List[np.ndarray]) -> List[np.ndarray]:
        """``groups`` in the order they are emitted: shuffled, or by first position; the probe's worst first."""
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, self.stats.windows])
            groups = [groups[k] for k in rng.permutation(len(groups))]
        else:
            groups = sorted(groups, key=self.pool.first_position)
        if self.cfg.probe_worst_case and self.stats.windows == 1 and groups:
            worst = max(range(len(groups)), key=lambda k: (self.pool.longest(groups[k]),
                                                           self.aligner.cost(groups[k])))
            groups.insert(0, groups.pop(worst))
        return groups

    def _note_one_length(self, lengths: np.ndarray) -> None:
        """Warn (once per loader) when every sample of the epoch's first window has one length: the batches
        are then a fixed batch size's, and odb has nothing to group (e.g. run_clm.py's block_size chunks)."""
        if "one_length" in self.notices or len(lengths) < ONE_LENGTH_MIN or (lengths != lengths[0]).any():
            return
        self.notices.add("one_length")
        cost = self.planner.cost
        fit = int(cost.copies_that_fit_unrounded(cost.pad(lengths[:1]))[0])
        length = int(lengths[0, 0]) if lengths.shape[1] == 1 else tuple(int(v) for v in lengths[0])
        what = "rows of" if self.cfg.layout == "packed" else "batches of"
        warnings.warn(f"odb: all {len(lengths)} samples of the epoch's first window have length {length}, so odb "
                      f"builds fixed {what} {fit} samples (token_budget={self.planner.costs.token_budget}), as a fixed batch "
                      f"size would: there is nothing to group by length, and no padding to save. Samples cut to one "
                      f"length (e.g. group_texts / block_size chunks of concatenated texts) leave odb nothing to "
                      f"gain. Fix: tokenize without concatenating (one sample per text, truncated to a max_length), "
                      f"so odb groups samples of different lengths; layout='packed' then also fills every row "
                      f"without padding (docs/packing.md).", UserWarning, stacklevel=2)

    def _oversize(self, sid: int) -> List[np.ndarray]:
        lengths, _, patches = self.pool.meta(sid)
        cfg, budget = self.cfg, self.planner.costs.token_budget
        policy = self.budget.oversize(cfg.oversize, int(sum(lengths)))
        if policy == "error":
            index = self.pool.indices([sid])[0]
            which = f"sample {index}" if index == sid else f"sample {index} (position {sid} of this rank's order)"
            if cfg.shape_buckets is not None:  # the rule is the buckets', not the budget alone
                raise ValueError(oversize_message(which, lengths if len(lengths) > 1 else lengths[0],
                                                  max(lengths), cfg.shape_buckets, budget))
            raise ValueError(
                f"{which} has length {lengths if len(lengths) > 1 else lengths[0]}"
                f"{f' and {patches} image patches' if cfg.image_patches_key else ''}, so alone it "
                f"exceeds token_budget={budget}"
                f"{f' / max_image_patches={cfg.max_image_patches}' if cfg.image_patches_key else ''}. "
                f"Rule: oversize='error' refuses such samples. Fix: raise token_budget, truncate samples "
                f"(e.g. tokenizer max_length), or pass oversize='alone' (own batch) or 'skip'.")
        if policy == "alone":
            self.stats.oversize_alone += 1
            return [np.array([sid], dtype=np.int64)]
        self.stats.oversize_skipped += 1
        self.pool.forget([sid])
        return []


class BudgetWindows:
    """Windows filled to the window limits and planned with the carry (no ``global_batch_size``). ``total``:
    the samples the epoch brings (None: unknown; known, the windows ramp down at its end); ``drop_last``:
    the last window's groups under half a batch are dropped."""

    fill_warning = True

    def __init__(self, groups: WindowGroups, *, total: Optional[int], drop_last: bool) -> None:
        self.groups, self.total, self.drop_last = groups, total, drop_last

    @property
    def micro_steps(self) -> Optional[int]:
        return self.groups.cfg.gradient_accumulation_steps

    def read(self, source: SampleSource, arrived: int) -> Tuple[List[Record], List[int], bool]:
        g = self.groups
        remaining = None if self.total is None else max(self.total - arrived, 0)
        records, ended = source.take(*window_limits(g.cfg, g.stats.windows, remaining, len(g.planner.carried_ids),
                                                    g.planner.window_tokens))
        return records, [int(r[0]) for r in records], ended

    def plan(self, ids: List[int], *, fresh: bool, final: bool, window_index: int, alone: bool) -> List[Step]:
        return self.groups.steps(self._cut, ids, fresh=fresh, final=final, window_index=window_index, alone=alone)

    def _cut(self, ids: List[int], final: bool) -> List[np.ndarray]:
        g = self.groups
        lengths, patches = g.measure(ids)
        probe = g.probe_window
        groups = g.groups(g.planner.plan(np.array(ids, dtype=np.int64), lengths, patches, final=final or probe))
        if final and self.drop_last:  # the last groups that fill less than half a batch
            keep = [x for x in groups if g.aligner.cost(x) >= 0.5 * g.planner.costs.total]
            kept = {id(x) for x in keep}
            for x in groups:
                if id(x) not in kept:
                    g.drop(x)
            groups = keep
        return g.order(groups)


class StepWindows:
    """Each window exactly the next optimizer step's ``step_samples`` samples of this rank (fewer at the
    end), as ``composer`` composes them (odb.epoch.composer: the sampler's order by default), planned whole;
    ``drops``: what drop_last keeps of a partial last step."""

    micro_steps: Optional[int] = None  # all of a window's steps make one optimizer step
    fill_warning = False  # a step's samples set the fill

    def __init__(self, groups: WindowGroups, step_samples: int, drops: DropLast, composer: StepComposer) -> None:
        self.groups, self.step_samples, self.drops, self.composer = groups, step_samples, drops, composer

    def read(self, source: SampleSource, arrived: int) -> Tuple[List[Record], List[int], bool]:
        return self.composer.next_step(source)

    def plan(self, ids: List[int], *, fresh: bool, final: bool, window_index: int, alone: bool) -> List[Step]:
        return self.groups.steps(self._cut, ids, fresh=fresh, final=final, window_index=window_index, alone=alone)

    def _cut(self, ids: List[int], final: bool) -> List[np.ndarray]:
        g = self.groups
        lengths, patches = g.measure(ids)
        kept = self.drops.kept(len(ids), self.step_samples) if final else len(ids)
        if kept < len(ids):  # a partial last optimizer step: drop_last drops the user's partial batch (or all)
            g.drop(ids[kept:])
            ids, lengths = ids[:kept], lengths[:kept]
            patches = None if patches is None else patches[:kept]
        groups = g.groups(g.planner.plan_step(np.array(ids, dtype=np.int64), lengths, patches))
        return g.order(groups)


class GlobalStepWindows:
    """Step windows, each step planned across ranks by ``step`` (odb.epoch.global_step), counted in
    ``stats`` and proposing ``budget``'s plan with its header; ``alone``: how a rank that goes on alone
    reads and plans (``StepWindows``)."""

    micro_steps: Optional[int] = None
    fill_warning = False

    def __init__(self, step: GlobalStep, alone: StepWindows, stats: EpochStats, budget: WindowBudget) -> None:
        self.step, self.alone, self.stats, self.budget = step, alone, stats, budget

    def read(self, source: SampleSource, arrived: int) -> Tuple[List[Record], List[int], bool]:
        return self.alone.read(source, arrived)

    def plan(self, ids: List[int], *, fresh: bool, final: bool, window_index: int, alone: bool) -> List[Step]:
        if alone:
            return self.alone.plan(ids, fresh=fresh, final=final, window_index=window_index, alone=alone)
        steps = self.step.plan(ids, final, window_index, self.budget.proposal())
        self.stats.windows += 1
        return steps


def window_strategy(groups: WindowGroups, exchange: Any, *, step_samples: Optional[int], total: Optional[int],
                    drops: DropLast, move_samples: bool, register: Callable[[int, int, Any, Any], None],
                    composer: Optional[StepComposer], tables: Any = None) -> Windows:
    """The windows of an epoch: budget-filled without ``step_samples`` (a rank's share of
    ``global_batch_size``), else step windows as ``composer`` composes them, planned across ranks with
    ``step_plan="global"`` and an ``exchange`` (samples move between ranks unless ``move_samples`` is False:
    known lengths; ``register`` holds what arrives; ``tables``: every step's table computed here,
    odb.epoch.local_table)."""
    if step_samples is None or composer is None:
        return BudgetWindows(groups, total=total, drop_last=drops.enabled)
    per_rank = StepWindows(groups, step_samples, drops, composer)
    if exchange is None or groups.cfg.step_plan != "global":
        return per_rank
    budget = groups.budget
    step = GlobalStep(groups.aligner, exchange, groups.planner, groups.pool, groups.stats, epoch=groups.epoch,
                      step_samples=step_samples, drops=drops, move_samples=move_samples, register=register,
                      oversize_policy=budget.oversize, check_length=budget.check_length, tables=tables)
    return GlobalStepWindows(step, per_rank, groups.stats, budget)
