"""One epoch of odb batching, as a chain of small stages.

source (records a window ahead) -> window (pool + ramp) -> WindowPlanner (pure) ->
RankAligner (one exchange per window) -> optimizer steps' micro-batches -> collate -> finalize.

``EpochRun`` produces ``(batch, Cursor)`` pairs; the loader runs it on a background
thread (odb.epoch.pipeline). A Cursor says where the epoch stands once its batch has been
consumed, cheaply: a reference to the state taken after the last planned window plus
the number of steps emitted since (see odb.resume).
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

import numpy as np

from odb.plan.ranks.align import MicroBatchPlan
from odb.config import ODBConfig
from odb.epoch.drop_last import DropLast
from odb.epoch.emission import BatchCollate, StepEmission
from odb.epoch.pool import SamplePool
from odb.epoch.peer_check import digests_of
from odb.epoch.position import RunPosition
from odb.epoch.ranks import RankAligner, Step
from odb.epoch.cursor import Cursor
from odb.epoch.composer import StepComposer
from odb.epoch.run_state import composed_positions, retained_positions
from odb.epoch.windows import WindowGroups, window_strategy
from odb.plan.steps.composition import make_composition
from odb.plan.ranks.pairing import make_pairing
from odb.data.source import SampleSource
from odb.epoch.stats import EpochStats
from odb.step_info import ODBStepInfo, loss_scale
from odb.plan.windows.window import WindowPlanner
from odb.epoch.budget import FixedBudget, WindowBudget


class EpochRun:
    """Iterates ``(batch, cursor)`` of one epoch. Built by the loader; not public API.

    Its units: the window budget (each window's prices), the window strategy (``windows``, odb.epoch.windows:
    how windows are read and planned), the sample pool, the window planner, the rank aligner, the counters,
    the position (``position``: where the epoch stands, resume bookkeeping), the emission of planned steps
    (``emission``) and the collate of their batches (``batches``)."""

    def __init__(self, cfg: ODBConfig, source: SampleSource, collate_fn: Callable[[List[Any]], Any],
                 *, epoch: int, seed: int, shuffle: bool, drop_last: bool = False, batch_unit: Optional[int] = None,
                 exchange: Any = None,
                 finalize: Optional[Callable[[Any], Any]] = None, total: Optional[int] = None,
                 notices: Optional[Set[str]] = None, budget: Optional[WindowBudget] = None,
                 stream_marks: Any = None, lazy: bool = False, move_samples: bool = True, tables: Any = None) -> None:
        self.cfg = cfg  # the user's options; each window's prices come from the window budget
        self.budget: WindowBudget = budget if budget is not None else FixedBudget(cfg)
        self.source = source
        self.epoch = epoch
        # (under a mesh one replica may span several processes: its peers still exchange, to agree on what each
        # measures and to check that they plan alike)
        exchange = exchange if exchange is not None and exchange.processes > 1 else None
        self.rank = exchange.rank if exchange is not None else 0
        self.world_size = exchange.world_size if exchange is not None else 1
        # global_batch_size: each window is one optimizer step's samples on this rank, planned whole
        step_samples = cfg.step_samples(self.world_size)
        self.stats = EpochStats()
        self.pool = SamplePool()
        self.planner = WindowPlanner(cfg, self.budget.costs)
        self.aligner = RankAligner(exchange, self.planner, self.pool, epoch=epoch, seed=seed, shuffle=shuffle,
                                   steps_done=lambda: self.stats.steps, whole_windows=step_samples is not None,
                                   pairing=make_pairing(cfg.balance, self.budget.time_model))
        groups = WindowGroups(cfg, self.planner, self.pool, self.aligner, self.stats, self.budget,
                              notices=notices if notices is not None else set(),  # warnings once per loader
                              rank=self.rank, epoch=epoch, seed=seed, shuffle=shuffle)
        # How windows are read and planned (odb.epoch.windows); step_plan="global": each optimizer step planned
        # across ranks, samples moving between them unless they are dataset indices (move_samples=False: known
        # lengths); drop_last keeps a partial last step's whole batches of the user's (batch_unit).
        # Which samples form each optimizer step (odb.epoch.composer; with global_batch_size only)
        self.composer = None if step_samples is None else StepComposer(
            make_composition(cfg.composition, block_steps=cfg.composition_block_steps,
                             warmup_steps=cfg.composition_warmup_steps), step_samples, seed=seed, epoch=epoch)
        self.windows = window_strategy(groups, exchange, step_samples=step_samples, total=total,
                                       drops=DropLast(drop_last, batch_unit), move_samples=move_samples,
                                       register=self.register, composer=self.composer, tables=tables)
        self.position = RunPosition(stream_marks)
        self.emission = StepEmission()
        # Batches left to collate (LazyBatch) by whichever thread needs them first (odb.epoch.pipeline).
        self.batches = BatchCollate(collate_fn, finalize, cfg.step_info_key, lazy=lazy)

    @property
    def finished(self) -> bool:
        """Every step of the epoch has been produced."""
        return self.aligner.all_done and self.emission.done

    @property
    def step(self) -> int:
        """Steps made so far this epoch."""
        return self.position.step

    @property
    def snapshot(self) -> Dict[str, Any]:
        """The state after the last planned window (what the cursors of the batches since point to)."""
        return self.position.snapshot

    @property
    def stream_marks(self) -> Any:
        """The restart points of a stream with its own state (None without one)."""
        return self.position.stream_marks

    @property
    def lazy(self) -> bool:
        """Whether batches are collated lazily (odb.epoch.pipeline.LazyBatch)."""
        return self.batches.lazy

    def close(self) -> None:
        self.source.close()

    # ---- resume ----------------------------------------------------------------------
    def take_snapshot(self) -> None:
        if self.position.stream_marks is not None:
            self.emission.keep_ghost_recent(self.pool)
        self.position.mark(self.state_dict())

    def state_dict(self) -> Dict[str, Any]:
        """This epoch's state as plain data (between batches; O(samples held)), one part per unit: the run's
        own place in the epoch (``position``), the window planner's, the rank aligner's, the counters' and the
        window budget's (odb.epoch.run_state.RUN_KEYS)."""
        position = self.position.state_dict(self.emission.state_dict(),
                                            None if self.composer is None else self.composer.state_dict())
        state = {"position": position, "planner": self.planner.state_dict(), "aligner": self.aligner.state_dict(),
                 "stats": self.stats.state_dict(), "budget": self.budget.state_dict()}
        self.position.cut_stream(state)
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
        emitted = set(samples) - set(int(i) for i in carry)
        for row in position["pending"] + position["micro"]:
            if row[0] is not None:
                emitted -= set(int(i) for i in row[0])
        emitted -= composed_positions(position)
        self.pool.forget(emitted)  # only the ghost's sample: it was emitted for real before
        if self.composer is not None:
            self.composer.reset(position["composed"])
        self.emission.load_state_dict(position, samples)
        self.position.load_state_dict(position)
        self.aligner.load_state_dict(state["aligner"])
        self.stats.load_state_dict(state["stats"])
        # Steps exchanged and not made yet: made and confirmed from here on.
        self.aligner.expect_confirmations(self.emission.planned())

    def restore(self, state: Dict[str, Any], samples: Dict[int, Tuple[int, Any, Any]]) -> None:
        """``load_state_dict``, then the snapshot the next batches' cursors point to."""
        self.load_state_dict(state, samples)
        # The saved ghost stays: moving it here (take_snapshot) would pick another sample than the interrupted
        # run, whose next move comes with its next window, as the resumed run's does.
        self.position.mark(self.state_dict())

    def register(self, sid: int, index: int, sample: Any, meta: Any) -> None:
        """Hold the sample at position ``sid`` of the epoch's order (dataset index ``index``)."""
        self.pool.add(sid, sample, meta, index)
        if not self.aligner.local_only:
            self.emission.offer_ghost(sid, sample, meta, index)

    # ---- window and plan -----------------------------------------------------------
    def _read_window(self) -> Tuple[List[int], bool]:
        records, ids, ended = self.windows.read(self.source, self.position.arrived)
        for sid, index, sample, meta in records:
            self.register(int(sid), int(index), sample, meta)
            self.position.arrived += 1
        return ids, ended

    def _plan_next_window(self) -> List[Step]:
        budget, alone, position = self.budget, self.aligner.local_only, self.position
        # the peers of a replica never plan under a proposal of their own (each measures its own): the agreed one
        own = alone and not self.aligner.has_peers
        self.planner.set_costs(budget.next_window(step=position.step, window_index=position.window_index,
                                                  planned=position.step + self.emission.planned(), alone=own))
        self.aligner.pairing.freeze(budget.freeze_point(position.step))
        ids: List[int] = []
        fresh = not position.planned_final
        if fresh:
            ids, position.planned_final = self._read_window()
        position.window_index += 1
        steps = self.windows.plan(ids, fresh=fresh, final=position.planned_final, window_index=position.window_index,
                                  alone=alone)
        budget.agreed(self.aligner.agreed_plan)
        return steps

    # ---- emitting ------------------------------------------------------------------
    def __iter__(self) -> Iterator[Tuple[Any, Cursor]]:
        k = self.windows.micro_steps  # micro-batches of an optimizer step (None: a window's steps, however many)
        emission = self.emission
        held: List[Tuple[Any, Cursor]] = []  # batches made, not yet confirmed by every rank
        while True:
            if emission.step_over:
                yield from self._confirmed(held)  # before planning: the next exchange may be a header
                planned = False
                while emission.wants(k) and not self.aligner.all_done:
                    emission.add(self._plan_next_window())
                    planned = True
                if planned:
                    self.take_snapshot()
                if not emission.pending:
                    break
                emission.start_step(k)
            plan, ids, micro, j = emission.next_micro()
            batch = self._make_batch(plan, ids, micro, j)
            held.append((batch, self.position.cursor(self.stats)))
            if len(held) >= self.aligner.confirm_every:
                yield from self._confirmed(held)
        yield from self._confirmed(held)
        self._warn_at_end()

    def _confirmed(self, held: List[Tuple[Any, Cursor]]) -> Iterator[Tuple[Any, Cursor]]:
        """The held batches, once every rank has made its own (one exchange for them all); empties ``held``."""
        if held:
            first, last = self.step - len(held), self.step - 1
            steps = f"{first}-{last}" if last > first else f"{first}"
            digest = digests_of([b for b, _ in held], self.cfg.step_info_key) if self.cfg.check_peers else 0
            self.aligner.confirm(len(held), f"epoch {self.epoch}, step {steps}", digest)
            out, held[:] = list(held), []
            yield from out

    def _warn_at_end(self) -> None:
        fill = self.stats.padded_tokens / max(self.stats.steps * self.planner.costs.total, 1)
        if self.world_size > 1 and self.stats.steps >= 10 and fill < 0.5 and not self.budget.learns() and \
                self.windows.fill_warning:  # (auto: it moves; global_batch_size: a step's samples set the fill)
            warnings.warn(f"odb rank {self.rank}: batches filled only {fill:.0%} of token_budget on "
                          f"average in epoch {self.epoch} (split groups: {self.stats.split_groups}, ghost steps: "
                          f"{self.stats.ghost_steps}): this rank's shard holds far fewer tokens than others'. "
                          f"Fix: shuffle samples across ranks (DistributedSampler(shuffle=True)) or balance "
                          f"shards by tokens.", stacklevel=3)
        if self.stats.oversize_skipped:
            warnings.warn(f"odb skipped {self.stats.oversize_skipped} sample(s) longer than token_budget="
                          f"{self.planner.costs.token_budget} in epoch {self.epoch} (oversize='skip').", stacklevel=3)

    def _make_batch(self, plan: MicroBatchPlan, group: Optional[np.ndarray], micro: List[MicroBatchPlan], j: int) -> Any:
        ghost = plan.group is None
        if ghost:
            copied = self.emission.ghost
            if copied is None:
                raise RuntimeError("odb must emit a ghost batch on a rank that received no sample this epoch. "
                                   "Fix: give every rank at least one sample (shard the data so no rank is empty).")
            ids = np.array([copied[0]])
            samples, metas = [copied[1]], [copied[2]]
            indices: List[int] = []
        else:
            ids = group
            indices = self.pool.indices(ids)  # what users see: dataset indices, not positions
            samples, metas = self.pool.pop(ids)
        lengths = np.array([m[0] for m in metas], dtype=np.int64)
        real = int(lengths.sum())
        padded = self.planner.cost.group_tokens(lengths)
        local_loss = 0 if ghost else plan.local_loss_tokens
        step = self.position.step
        if not ghost:
            self.budget.made(step, lengths, metas, self.planner.cost)
        info = ODBStepInfo(
            micro_batch=step, epoch=self.epoch, local_samples=0 if ghost else len(ids),
            all_samples_this_step=plan.global_samples, local_loss_tokens=local_loss,
            global_loss_tokens=sum(p.global_loss_tokens for p in micro), real_tokens=0 if ghost else real,
            padded_tokens=padded, loss_scale=0.0 if ghost else self._scale(plan, micro),
            is_ghost=ghost, world_size=self.world_size, micro_step=j, micro_steps=len(micro),
            sample_ids=tuple(indices), buffered_samples=len(self.pool),
            rank_imbalance=plan.imbalance, optimizer_step=self.position.optimizer_step)
        self.position.step += 1
        if j == len(micro) - 1:
            self.position.optimizer_step += 1
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
        return self.batches.make(samples, info)

    def _scale(self, plan: MicroBatchPlan, micro: List[MicroBatchPlan]) -> float:
        """The loss scale of one micro-batch of the optimizer step ``micro`` (odb.step_info.loss_scale)."""
        mode, w = self.cfg.loss_scaling, self.world_size
        planned = 1.0
        if mode == "sample":
            samples = sum(p.global_samples for p in micro)
            planned = w * plan.local_samples / samples if samples else 0.0
        return loss_scale(mode, plan.local_loss_tokens, sum(p.global_loss_tokens for p in micro),
                          sum(p.local_loss_tokens for p in micro), w, planned)
