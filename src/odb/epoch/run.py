"""One epoch of odb batching, as a chain of small stages.

source (records a window ahead) -> window (pool + ramp) -> WindowPlanner (pure) ->
RankAligner (one exchange per window) -> optimizer steps' micro-batches -> collate -> finalize.

``EpochRun`` produces ``(batch, Cursor)`` pairs; the loader runs it on a background
thread (odb.epoch.pipeline). A Cursor says where the epoch stands once its batch has been
consumed, cheaply: a reference to the state taken after the last planned window plus
the number of steps emitted since (see odb.resume).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import threading
import warnings
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

from odb.plan.align import StepPlan
from odb.plan.buckets import oversize_message
from odb.config import ODBConfig
from odb.epoch.drop_last import DropLast
from odb.epoch.global_step import GlobalStep
from odb.epoch.pool import SamplePool
from odb.epoch.ranks import RankAligner, Step
from odb.epoch.cursor import Cursor
from odb.epoch.pipeline import LazyBatch
from odb.epoch.run_state import retained_positions, step_from_row, step_row
from odb.plan.pairing import make_pairing
from odb.data.source import SampleSource
from odb.epoch.stats import EpochStats
from odb.step_info import ODBStepInfo, attach_step_info, loss_scale
from odb.plan.window import WindowPlanner, window_limits
from odb.epoch.budget import FixedBudget, WindowBudget

ONE_LENGTH_MIN = 32  # samples of one length in a first window before odb says there is nothing to group


class EpochRun:
    """Iterates ``(batch, cursor)`` of one epoch. Built by the loader; not public API."""

    def __init__(self, cfg: ODBConfig, source: SampleSource, collate_fn: Callable[[List[Any]], Any],
                 *, epoch: int, seed: int, shuffle: bool, drop_last: bool = False, batch_unit: Optional[int] = None,
                 exchange: Any = None,
                 finalize: Optional[Callable[[Any], Any]] = None, total: Optional[int] = None,
                 notices: Optional[Set[str]] = None, budget: Optional[WindowBudget] = None,
                 stream_marks: Any = None, lazy: bool = False, move_samples: bool = True) -> None:
        self.cfg = cfg  # the user's options; each window's prices come from the window budget
        self.budget: WindowBudget = budget if budget is not None else FixedBudget(cfg)
        self.notices = notices if notices is not None else set()  # warnings given once per loader, not per epoch
        self.total = total  # samples this epoch brings (None: unknown, e.g. an IterableDataset)
        self.source = source
        self._collate = collate_fn
        self._finalize = finalize
        self.epoch, self.seed, self.shuffle, self.drop_last = epoch, seed, shuffle, drop_last
        self.drops = DropLast(drop_last, batch_unit)  # a partial last step: its whole batches of the user's kept
        exchange = exchange if exchange is not None and exchange.world_size > 1 else None
        self.rank = exchange.rank if exchange is not None else 0
        self.world_size = exchange.world_size if exchange is not None else 1
        # global_batch_size: each window is one optimizer step's samples on this rank, planned whole
        self.step_samples = cfg.step_samples(self.world_size)
        self.stats = EpochStats()
        self.pool = SamplePool()
        self.planner = WindowPlanner(cfg, self.budget.costs)
        self.aligner = RankAligner(exchange, self.planner, self.pool, epoch=epoch, seed=seed, shuffle=shuffle,
                                   steps_done=lambda: self.stats.steps, whole_windows=self.step_samples is not None,
                                   pairing=make_pairing(cfg.balance, self.budget.time_model))
        # step_plan="global": each optimizer step planned across ranks (odb.epoch.global_step); samples move
        # between ranks unless they are dataset indices (``move_samples=False``: known lengths)
        self.global_step = GlobalStep(
            self.aligner, exchange, self.planner, self.pool, self.stats, epoch=epoch, step_samples=self.step_samples,
            drops=self.drops, move_samples=move_samples, register=self.register,
            oversize_policy=self.budget.oversize, check_length=self.budget.check_length) \
            if self.step_samples is not None and exchange is not None and cfg.step_plan == "global" else None
        self.arrived = 0  # samples taken from the source into windows
        self.window_index = 0
        self.planned_final = False
        # Steps planned but not emitted yet, and the micro-batches of the optimizer step being emitted
        # (saved as "micro" and "micro_pos" of the state's "position").
        self.pending: Deque[Step] = collections.deque()
        self.step_batches: List[Step] = []
        self.step_pos = 0
        self.ghost: Optional[Tuple[int, Any, Any, int]] = None  # (position, sample copy, meta, dataset index)
        # Resume bookkeeping (odb.resume): re-partitions of this epoch's order across ranks, and the
        # resume points of an IterableDataset with its own state (odb.data.stream_state), when it has one.
        self.layers: List[Dict[str, Any]] = []
        self.stream_marks: Any = stream_marks
        self.step = 0
        self.snapshot: Dict[str, Any] = {}  # state_dict() after the last planned window
        self._since = 0
        # Batches left to collate (LazyBatch) by whichever thread needs them first (odb.epoch.pipeline).
        self.lazy = lazy
        self._collate_lock = threading.Lock()

    @property
    def finished(self) -> bool:
        """Every step of the epoch has been produced."""
        return self.aligner.all_done and not self.pending and self.step_pos >= len(self.step_batches)

    def close(self) -> None:
        self.source.close()

    # ---- resume ----------------------------------------------------------------------
    def take_snapshot(self) -> None:
        if self.stream_marks is not None:
            self._keep_ghost_recent()
        self.snapshot, self._since = self.state_dict(), 0

    def _keep_ghost_recent(self) -> None:
        """A stream resumes from before the first sample its state holds, the ghost's included: keep the
        ghost a copy of a held sample, so the stream's replay stays about a window long."""
        low = self.pool.lowest()
        if self.ghost is not None and low is not None and self.ghost[0] < low:
            self.ghost = (low, copy.deepcopy(self.pool.sample(low)), self.pool.meta(low), self.pool.indices([low])[0])

    def state_dict(self) -> Dict[str, Any]:
        """This epoch's state as plain data (between batches; O(samples held)), one part per unit: the run's
        own place in the epoch (``position``), the window planner's, the rank aligner's, the counters' and the
        window budget's (odb.epoch.run_state.RUN_KEYS)."""
        # Micro-batches of the current optimizer step already emitted keep only their
        # summaries (the loss-scale denominator needs them), not their samples.
        micro = [step_row((plan, None) if k < self.step_pos else (plan, ids))
                 for k, (plan, ids) in enumerate(self.step_batches)]
        position = {"arrived": self.arrived, "planned_final": self.planned_final, "window_index": self.window_index,
                    "step": self.step, "pending": [step_row(e) for e in self.pending], "micro": micro,
                    "micro_pos": self.step_pos, "ghost": None if self.ghost is None else int(self.ghost[0]),
                    "layers": self.layers, "stream": None, "step_tokens": None}
        state = {"position": position, "planner": self.planner.state_dict(), "aligner": self.aligner.state_dict(),
                 "stats": self.stats.state_dict(), "budget": self.budget.state_dict()}
        if self.stream_marks is not None:  # the latest restart point of the stream before every retained sample
            position["stream"] = self.stream_marks.cut(min(retained_positions(state), default=self.arrived))
        return state

    def load_state_dict(self, state: Dict[str, Any], samples: Dict[int, Tuple[int, Any, Any]]) -> None:
        """Continue from ``state_dict``'s output; ``samples`` maps every retained position to
        (dataset index, sample, meta)."""
        for sid in sorted(retained_positions(state, foreign=True)):
            index, sample, meta = samples[sid]
            self.register(sid, int(index), sample, meta)
        self.budget.load_state_dict(state["budget"])
        self.planner.set_costs(self.budget.costs)
        carry = np.asarray(state["planner"]["carry"], dtype=np.int64)
        self.planner.load_state_dict(state["planner"], self.pool.lengths(carry), self.pool.side(carry, self.aligner.side))
        position = state["position"]
        if position["ghost"] is not None:
            gid = int(position["ghost"])
            index, sample, meta = samples[gid]
            self.ghost = (gid, copy.deepcopy(sample), meta, int(index))  # the pool may emit the same sample
        emitted = set(samples) - set(int(i) for i in carry)
        for row in position["pending"] + position["micro"]:
            if row[0] is not None:
                emitted -= set(int(i) for i in row[0])
        self.pool.forget(emitted)  # only the ghost's sample: it was emitted for real before
        self.pending.extend(step_from_row(r) for r in position["pending"])
        self.step_batches = [step_from_row(r) for r in position["micro"]]
        self.step_pos = int(position["micro_pos"])
        self.arrived = int(position["arrived"])
        self.planned_final = bool(position["planned_final"])
        self.aligner.load_state_dict(state["aligner"])
        self.window_index = int(position["window_index"])
        self.step = int(position["step"])
        self.layers = [dict(layer) for layer in position["layers"]]
        self.stats.load_state_dict(state["stats"])
        # Steps exchanged and not made yet: made and confirmed from here on.
        self.aligner.expect_confirmations(len(self.pending) + len(self.step_batches) - self.step_pos)

    def restore(self, state: Dict[str, Any], samples: Dict[int, Tuple[int, Any, Any]]) -> None:
        """``load_state_dict``, then the snapshot the next batches' cursors point to."""
        self.load_state_dict(state, samples)
        # The saved ghost stays: moving it here (take_snapshot) would pick another sample than the interrupted
        # run, whose next move comes with its next window, as the resumed run's does.
        self.snapshot, self._since = self.state_dict(), 0

    def register(self, sid: int, index: int, sample: Any, meta: Any) -> None:
        """Hold the sample at position ``sid`` of the epoch's order (dataset index ``index``)."""
        self.pool.add(sid, sample, meta, index)
        if self.ghost is None and not self.aligner.local_only:
            # A copy: the user's collate_fn may change the real sample when it is emitted.
            self.ghost = (sid, copy.deepcopy(sample), meta, index)

    # ---- window and plan -----------------------------------------------------------
    def _remaining(self) -> Optional[int]:
        return None if self.total is None else max(self.total - self.arrived, 0)

    def _read_window(self) -> Tuple[List[int], bool]:
        if self.step_samples is not None:  # the next optimizer step's samples, exactly (fewer at the end)
            records, ended = [], False
            while len(records) < self.step_samples and not ended:
                more, ended = self.source.take(self.step_samples - len(records), None)
                records.extend(more)
        else:
            records, ended = self.source.take(*window_limits(self.cfg, self.stats.windows, self._remaining(),
                                                              len(self.planner.carried_ids),
                                                              self.planner.window_tokens))
        ids = []
        for sid, index, sample, meta in records:
            self.register(int(sid), int(index), sample, meta)
            self.arrived += 1
            ids.append(int(sid))
        return ids, ended

    def _plan_next_window(self) -> List[Step]:
        budget, alone = self.budget, self.aligner.local_only
        planned = self.step + len(self.step_batches) - self.step_pos + len(self.pending)
        self.planner.set_costs(budget.next_window(step=self.step, window_index=self.window_index, planned=planned,
                                                  alone=alone))
        self.aligner.pairing.freeze(budget.freeze_point(self.step))
        if self.global_step is not None and not alone:
            return self._plan_global_step(self.global_step, budget)
        groups: List[np.ndarray] = []
        if not self.planned_final:
            ids, final = self._read_window()
            groups = self._plan(ids, final)
            self.planned_final = final
        elif len(self.planner.carried_ids):  # groups deferred by the alignment after the data ended
            groups = self._plan([], True)
        self.window_index += 1
        steps = self.aligner.align(groups, self.planned_final, self.window_index,
                                   None if alone else budget.proposal())
        budget.agreed(self.aligner.agreed_plan)
        fit = self.aligner.last_fit
        self.stats.deferred_groups += fit.deferred
        self.stats.carry_groups += fit.from_carry
        self.stats.split_groups += fit.split
        return steps

    def _plan_global_step(self, step: GlobalStep, budget: WindowBudget) -> List[Step]:
        """The next optimizer step planned across ranks (odb.epoch.global_step): this rank's micro-batches."""
        ids: List[int] = []
        if not self.planned_final:
            ids, self.planned_final = self._read_window()
        self.window_index += 1
        steps = step.plan(ids, self.planned_final, self.window_index, budget.proposal())
        self.stats.windows += 1
        budget.agreed(self.aligner.agreed_plan)
        return steps

    def _plan(self, ids: List[int], final: bool) -> List[np.ndarray]:
        cfg = self.cfg
        patches = self.pool.side(ids, self.aligner.side)  # image patches and supervised tokens, when they count
        lengths = self.pool.lengths(ids)
        if len(lengths) and cfg.oversize != "skip":
            self.budget.check_length(int(lengths.sum(axis=1).max()))  # refuses what no batch can hold (auto's cap)
        if self.stats.windows == 0 and self.rank == 0:
            self._note_one_length(lengths)
        # The probe's window emits all it holds: its longest samples must not wait in the carry for a fuller batch.
        probe = cfg.probe_worst_case and self.stats.windows == 0
        step = self.step_samples is not None
        kept = self.drops.kept(len(ids), self.step_samples) if step and final else len(ids)
        if kept < len(ids):  # a partial last optimizer step: drop_last drops the user's partial batch (or all)
            self.stats.dropped_samples += len(ids) - kept
            self.pool.forget(ids[kept:])
            ids, lengths = ids[:kept], lengths[:kept]
            patches = None if patches is None else patches[:kept]
        if step:
            planned = self.planner.plan_step(np.array(ids, dtype=np.int64), lengths, patches)
        else:
            planned = self.planner.plan(np.array(ids, dtype=np.int64), lengths, patches, final=final or probe)
        self.stats.windows += 1
        groups = list(planned.groups)
        for sid in planned.oversize.tolist():
            groups.extend(self._oversize(sid))
        if final and self.drop_last and not step:
            keep = [g for g in groups if self.aligner.cost(g) >= 0.5 * self.planner.costs.total]
            kept = {id(g) for g in keep}
            for g in groups:
                if id(g) not in kept:
                    self.stats.dropped_samples += len(g)
                    self.pool.forget(g)
            groups = keep
        return self._order(groups)

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
            if cfg.shape_buckets is not None:  # the rule is the buckets', not the budget alone
                raise ValueError(oversize_message(f"sample {sid}", lengths if len(lengths) > 1 else lengths[0],
                                                  max(lengths), cfg.shape_buckets, budget))
            raise ValueError(
                f"sample {sid} has length {lengths if len(lengths) > 1 else lengths[0]}"
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

    def _order(self, groups: List[np.ndarray]) -> List[np.ndarray]:
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

    # ---- emitting ------------------------------------------------------------------
    def __iter__(self) -> Iterator[Tuple[Any, Cursor]]:
        # global_batch_size: an optimizer step is one window's steps, however many; else k micro-batches
        k = self.cfg.gradient_accumulation_steps if self.step_samples is None else None
        held: List[Tuple[Any, Cursor]] = []  # batches made, not yet confirmed by every rank
        while True:
            if self.step_pos >= len(self.step_batches):
                yield from self._confirmed(held)  # before planning: the next exchange may be a header
                planned = False
                while (len(self.pending) < k if k is not None else not self.pending) and not self.aligner.all_done:
                    self.pending.extend(self._plan_next_window())
                    planned = True
                if planned:
                    self.take_snapshot()
                if not self.pending:
                    break
                take = len(self.pending) if k is None else min(k, len(self.pending))
                self.step_batches = [self.pending.popleft() for _ in range(take)]
                self.step_pos = 0
            j = self.step_pos
            self.step_pos += 1
            plan, ids = self.step_batches[j]
            batch = self._make_batch(plan, ids, [p for p, _ in self.step_batches], j)
            self._since += 1
            held.append((batch, Cursor(self.snapshot, self._since, dataclasses.replace(self.stats))))
            if len(held) >= self.aligner.confirm_every:
                yield from self._confirmed(held)
        yield from self._confirmed(held)
        self._warn_at_end()

    def _confirmed(self, held: List[Tuple[Any, Cursor]]) -> Iterator[Tuple[Any, Cursor]]:
        """The held batches, once every rank has made its own (one exchange for them all); empties ``held``."""
        if held:
            first, last = self.step - len(held), self.step - 1
            steps = f"{first}-{last}" if last > first else f"{first}"
            self.aligner.confirm(len(held), f"epoch {self.epoch}, step {steps}")
            out, held[:] = list(held), []
            yield from out

    def _warn_at_end(self) -> None:
        fill = self.stats.padded_tokens / max(self.stats.steps * self.planner.costs.total, 1)
        if self.world_size > 1 and self.stats.steps >= 10 and fill < 0.5 and not self.budget.learns() and \
                self.step_samples is None:  # (auto: it moves; global_batch_size: a step's samples set the fill)
            warnings.warn(f"odb rank {self.rank}: batches filled only {fill:.0%} of token_budget on "
                          f"average in epoch {self.epoch} (split groups: {self.stats.split_groups}, ghost steps: "
                          f"{self.stats.ghost_steps}): this rank's shard holds far fewer tokens than others'. "
                          f"Fix: shuffle samples across ranks (DistributedSampler(shuffle=True)) or balance "
                          f"shards by tokens.", stacklevel=3)
        if self.stats.oversize_skipped:
            warnings.warn(f"odb skipped {self.stats.oversize_skipped} sample(s) longer than token_budget="
                          f"{self.planner.costs.token_budget} in epoch {self.epoch} (oversize='skip').", stacklevel=3)

    def _make_batch(self, plan: StepPlan, group: Optional[np.ndarray], micro: List[StepPlan], j: int) -> Any:
        ghost = plan.group is None
        if ghost:
            if self.ghost is None:
                raise RuntimeError("odb must emit a ghost batch on a rank that received no sample this epoch. "
                                   "Fix: give every rank at least one sample (shard the data so no rank is empty).")
            ids = np.array([self.ghost[0]])
            samples, metas = [self.ghost[1]], [self.ghost[2]]
            indices: List[int] = []
        else:
            ids = group
            indices = self.pool.indices(ids)  # what users see: dataset indices, not positions
            samples, metas = self.pool.pop(ids)
        lengths = np.array([m[0] for m in metas], dtype=np.int64)
        real = int(lengths.sum())
        padded = self.planner.cost.group_tokens(lengths)
        local_loss = 0 if ghost else plan.local_loss_tokens
        if not ghost:
            self.budget.made(self.step, lengths, metas, self.planner.cost)
        info = ODBStepInfo(
            step=self.step, epoch=self.epoch, local_samples=0 if ghost else len(ids),
            all_samples_this_step=plan.global_samples, local_loss_tokens=local_loss,
            global_loss_tokens=sum(p.global_loss_tokens for p in micro), real_tokens=0 if ghost else real,
            padded_tokens=padded, loss_scale=0.0 if ghost else self._scale(plan, micro),
            is_ghost=ghost, world_size=self.world_size, micro_step=j, micro_steps=len(micro),
            sample_ids=tuple(indices), buffered_samples=len(self.pool),
            rank_imbalance=plan.imbalance)
        self.step += 1
        st = self.stats
        st.steps += 1
        st.buffered_max = max(st.buffered_max, len(self.pool))
        st.buffered_tokens_max = max(st.buffered_tokens_max, self.pool.tokens)
        st.buffered_sum += len(self.pool)
        st.imbalance_sum += plan.imbalance
        st.imbalance_max = max(st.imbalance_max, plan.imbalance)
        st.ghost_steps += ghost
        st.samples += info.local_samples
        st.real_tokens += info.real_tokens
        st.padded_tokens += padded
        st.loss_tokens += local_loss
        if self.lazy:
            return LazyBatch(samples, info, self._finish, self._collate_lock)
        return self._finish(samples, info)

    def _finish(self, samples: List[Any], info: ODBStepInfo) -> Any:
        batch = self._collate(samples)
        if self._finalize is not None:
            batch = self._finalize(batch)
        return attach_step_info(batch, info, self.cfg.step_info_key)

    def _scale(self, plan: StepPlan, micro: List[StepPlan]) -> float:
        """The loss scale of one micro-batch of the optimizer step ``micro`` (odb.step_info.loss_scale)."""
        mode, w = self.cfg.loss_scaling, self.world_size
        planned = 1.0
        if mode == "sample":
            samples = sum(p.global_samples for p in micro)
            planned = w * plan.local_samples / samples if samples else 0.0
        return loss_scale(mode, plan.local_loss_tokens, sum(p.global_loss_tokens for p in micro),
                          sum(p.local_loss_tokens for p in micro), w, planned)
