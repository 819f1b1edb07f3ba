"""One epoch of online dynamic batching over a stream of processed samples.

stream of (id, sample) chunks -> windows of buffer_size -> WindowPlanner -> batch
order -> rank alignment -> optimizer-step accounting -> collate_fn -> batch + info.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import time
import warnings
from typing import Any, Callable, Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from .align import StepPlan, local_steps
from .config import ODBConfig
from .dist import RankExchange
from .lengths import as_length_tuple, count_loss_tokens, default_length, image_patches
from .ranks import RankFitting
from .schedule import budget_at
from .resume import ResumableRun
from .stats import EpochStats
from .step_info import ODBStepInfo, attach_step_info
from .window import WindowPlanner


@dataclasses.dataclass(frozen=True)
class _Meta:
    lengths: Tuple[int, ...]
    loss_tokens: int
    patches: int
    position: int  # arrival position in this epoch


class EpochRun(RankFitting, ResumableRun):
    """Iterates the batches of one epoch. Built by the loader; not public API."""

    def __init__(self, cfg: ODBConfig, chunks: Iterable[List[Tuple[int, Any]]], collate_fn: Callable[[List[Any]], Any],
                 *, epoch: int, seed: int, shuffle: bool, drop_last: bool = False,
                 exchange: Optional[RankExchange] = None,
                 finalize: Optional[Callable[[Any], Any]] = None) -> None:
        self.cfg = cfg
        self._chunks = iter(chunks)
        self._collate = collate_fn
        self._finalize = finalize
        self.epoch, self.seed, self.shuffle, self.drop_last = epoch, seed, shuffle, drop_last
        self._exchange = exchange if exchange is not None and exchange.world_size > 1 else None
        self.world_size = self._exchange.world_size if self._exchange else 1
        self._local_only = self._exchange is None
        self._window_index = 0
        self.planner = WindowPlanner(cfg)
        self.stats = EpochStats()
        self._length_fn = cfg.length_fn or default_length
        self._samples: Dict[int, Any] = {}
        self._meta: Dict[int, _Meta] = {}
        self._leftover: List[Tuple[int, Any]] = []
        self._arrived = 0
        self._exhausted = False
        self._all_done = False
        self._planned_final = False
        # Steps planned but not emitted yet, and the optimizer step being emitted.
        self._pending: Deque[Tuple[StepPlan, Optional[np.ndarray]]] = collections.deque()
        self._chunk: List[Tuple[StepPlan, Optional[np.ndarray]]] = []
        self._chunk_pos = 0
        self._ghost: Optional[Tuple[int, Any, _Meta]] = None
        self._step = 0

    def close(self) -> None:
        """Let go of the sample stream, and so of the inner loader's worker processes."""
        self._chunks = iter(())

    # ---- reading -------------------------------------------------------------------
    def _read_window(self) -> List[int]:
        """Ids of the next buffer_size processed samples (fewer at the end of data)."""
        cfg = self.cfg
        first = cfg.buffer_size if cfg.probe_worst_case else cfg.first_window_size
        want = min(cfg.buffer_size, first << min(self.stats.windows, 30))
        got: List[Tuple[int, Any]] = self._leftover
        while len(got) < want and not self._exhausted:
            try:
                got = got + list(next(self._chunks))
            except StopIteration:
                self._exhausted = True
        window, self._leftover = got[:want], got[want:]
        if not self._leftover and not self._exhausted:
            self._exhausted = self._peek_end()
        ids = []
        for sid, sample in window:
            self._register(sid, sample)
            ids.append(sid)
        return ids

    def _peek_end(self) -> bool:
        # Knowing that this window is the last lets the planner flush it instead of
        # carrying samples into a window that never comes.
        try:
            self._leftover = list(next(self._chunks))
            return False
        except StopIteration:
            return True

    def _register(self, sid: int, sample: Any) -> None:
        cfg = self.cfg
        if sid in self._samples:
            raise ValueError(f"sample id {sid} arrived twice in one epoch: odb emits every sample once. "
                             f"Fix: make the sampler yield each index at most once per epoch.")
        lengths = as_length_tuple(self._length_fn(sample), sid)
        loss = cfg.loss_tokens_fn(sample) if cfg.loss_tokens_fn else count_loss_tokens(
            sample, cfg.label_key, cfg.ignore_index, cfg.shift_labels, fallback=lengths[0])
        patches = image_patches(sample, cfg.image_patches_key) if cfg.image_patches_key else 0
        self._samples[sid] = sample
        self._meta[sid] = _Meta(lengths, int(loss), patches, self._arrived)
        self._arrived += 1
        if self._ghost is None and self._exchange is not None:
            # A copy: the user's collate_fn may change the real sample when it is emitted.
            self._ghost = (sid, copy.deepcopy(sample), self._meta[sid])

    # ---- planning ------------------------------------------------------------------
    def set_token_budget(self, budget: Any) -> None:
        """Plan the next windows under ``budget`` (steps already planned keep theirs)."""
        if budget != self.cfg.token_budget:
            self.cfg = self.cfg.replace(token_budget=budget)
            self.planner.set_config(self.cfg)

    def _follow_schedule(self) -> None:
        schedule = self.cfg.budget_schedule
        if schedule is not None:
            planned = self._step + len(self._chunk) - self._chunk_pos + len(self._pending)
            self.set_token_budget(budget_at(schedule, planned // self.cfg.gradient_accumulation_steps))

    def _plan_next_window(self) -> List[Tuple[StepPlan, Optional[np.ndarray]]]:
        self._follow_schedule()
        groups: List[np.ndarray] = []
        if not self._planned_final:
            ids = self._read_window()
            final = self._exhausted and not self._leftover
            groups = self._plan(ids, final)
            self._planned_final = final
        elif len(self.planner.carried_ids):  # groups deferred by the alignment after the data ended
            groups = self._plan([], True)
        self._window_index += 1
        if self._local_only:
            self._all_done = self._planned_final
            return self._local_steps(groups)
        return self._align_ranks(groups)

    def _local_steps(self, groups: List[np.ndarray]) -> List[Tuple[StepPlan, Optional[np.ndarray]]]:
        return [(s, groups[s.group]) for s in local_steps(self._loss(groups), [len(g) for g in groups])]

    def _loss(self, groups: List[np.ndarray]) -> List[int]:
        return [sum(self._meta[int(i)].loss_tokens for i in g) for g in groups]

    def _plan(self, ids: List[int], final: bool) -> List[np.ndarray]:
        cfg = self.cfg
        lengths = np.array([self._meta[i].lengths for i in ids], dtype=np.int64).reshape(len(ids), -1) \
            if ids else np.empty((0, self._dims()), dtype=np.int64)
        patches = np.array([self._meta[i].patches for i in ids], dtype=np.int64) if cfg.image_patches_key else None
        planned = self.planner.plan(np.array(ids, dtype=np.int64), lengths, patches, final=final)
        self.stats.windows += 1
        groups = list(planned.groups)
        for sid in planned.oversize.tolist():
            groups.extend(self._oversize(sid))
        if final and self.drop_last:
            keep = [g for g in groups if self._cost(g) >= 0.5 * sum(cfg.token_budgets)]
            for g in groups:
                if not any(g is k for k in keep):
                    self.stats.dropped_samples += len(g)
                    self._forget(g)
            groups = keep
        return self._order(groups)

    def _dims(self) -> int:
        meta = next(iter(self._meta.values()), None)
        return len(meta.lengths) if meta else 1

    def _oversize(self, sid: int) -> List[np.ndarray]:
        meta, policy = self._meta[sid], self.cfg.oversize
        if policy == "error":
            raise ValueError(
                f"sample {sid} has length {meta.lengths if len(meta.lengths) > 1 else meta.lengths[0]}"
                f"{f' and {meta.patches} image patches' if self.cfg.image_patches_key else ''}, so alone it "
                f"exceeds token_budget={self.cfg.token_budget}"
                f"{f' / max_image_patches={self.cfg.max_image_patches}' if self.cfg.image_patches_key else ''}. "
                f"Rule: oversize='error' refuses such samples. Fix: raise token_budget, truncate samples "
                f"(e.g. tokenizer max_length), or pass oversize='alone' (own batch) or 'skip'.")
        if policy == "alone":
            self.stats.oversize_alone += 1
            return [np.array([sid], dtype=np.int64)]
        self.stats.oversize_skipped += 1
        self._forget([sid])
        return []

    def _forget(self, ids: Iterable[int]) -> None:
        for i in ids:
            self._samples.pop(int(i), None)

    def _defer(self, group: np.ndarray) -> None:
        metas = [self._meta[int(i)] for i in group]
        self.planner.defer(group, np.array([m.lengths for m in metas]),
                           np.array([m.patches for m in metas]) if self.cfg.image_patches_key else None)

    def _order(self, groups: List[np.ndarray]) -> List[np.ndarray]:
        if self.shuffle:
            rng = np.random.default_rng([self.seed, self.epoch, self.stats.windows])
            groups = [groups[k] for k in rng.permutation(len(groups))]
        else:
            groups = sorted(groups, key=lambda g: min(self._meta[int(i)].position for i in g))
        if self.cfg.probe_worst_case and self.stats.windows == 1 and groups:
            worst = max(range(len(groups)), key=lambda k: (self._longest(groups[k]), self._cost(groups[k])))
            groups.insert(0, groups.pop(worst))
        return groups

    def _longest(self, group: np.ndarray) -> int:
        return max(sum(self._meta[int(i)].lengths) for i in group)

    def _cost(self, group: np.ndarray) -> int:
        lengths = np.array([self._meta[int(i)].lengths for i in group])
        padded = self.planner.cost.pad(lengths)
        return int(len(group) * padded.max(axis=0).sum())

    # ---- emitting ------------------------------------------------------------------
    def __iter__(self) -> Iterator[Any]:
        k = self.cfg.gradient_accumulation_steps
        asked = time.perf_counter()
        while True:
            if self._chunk_pos >= len(self._chunk):
                while len(self._pending) < k and not self._all_done:
                    self._pending.extend(self._plan_next_window())
                if not self._pending:
                    break
                self._chunk = [self._pending.popleft() for _ in range(min(k, len(self._pending)))]
                self._chunk_pos = 0
            j = self._chunk_pos
            self._chunk_pos += 1
            plan, ids = self._chunk[j]
            batch = self._make_batch(plan, ids, [p for p, _ in self._chunk], j, time.perf_counter() - asked)
            yield batch
            asked = time.perf_counter()  # the training loop asks for the next batch
        fill = self.stats.padded_tokens / max(self.stats.steps * sum(self.cfg.token_budgets), 1)
        if self.world_size > 1 and self.stats.steps >= 10 and fill < 0.5:
            warnings.warn(f"odb rank {self._exchange.rank}: batches filled only {fill:.0%} of token_budget on "
                          f"average in epoch {self.epoch} (split groups: {self.stats.split_groups}, ghost steps: "
                          f"{self.stats.ghost_steps}): this rank's shard holds far fewer tokens than others'. "
                          f"Fix: shuffle samples across ranks (DistributedSampler(shuffle=True)) or balance "
                          f"shards by tokens.", stacklevel=2)
        if self.stats.oversize_skipped:
            warnings.warn(f"odb skipped {self.stats.oversize_skipped} sample(s) longer than token_budget="
                          f"{self.cfg.token_budget} in epoch {self.epoch} (oversize='skip').", stacklevel=2)

    def _make_batch(self, plan: StepPlan, group: Optional[np.ndarray], chunk: List[StepPlan], j: int,
                    waited_s: float) -> Any:
        ghost = plan.group is None
        if ghost:
            if self._ghost is None:
                raise RuntimeError("odb must emit a ghost batch on a rank that received no sample this epoch. "
                                   "Fix: give every rank at least one sample (shard the data so no rank is empty).")
            ids = np.array([self._ghost[0]])
            samples = [self._ghost[1]]
            metas = [self._ghost[2]]
        else:
            ids = group
            samples = [self._samples.pop(int(i)) for i in ids]
            metas = [self._meta.pop(int(i)) for i in ids]
        lengths = np.array([m.lengths for m in metas])
        real = int(lengths.sum())
        padded = int(len(ids) * self.planner.cost.pad(lengths).max(axis=0).sum())
        local_loss = 0 if ghost else plan.local_loss_tokens
        info = ODBStepInfo(
            step=self._step, epoch=self.epoch, local_samples=0 if ghost else len(ids),
            all_samples_this_step=plan.global_samples, local_loss_tokens=local_loss,
            global_loss_tokens=sum(p.global_loss_tokens for p in chunk), real_tokens=0 if ghost else real,
            padded_tokens=padded, loss_scale=0.0 if ghost else self._scale(plan, chunk),
            is_ghost=ghost, world_size=self.world_size, micro_step=j, micro_steps=len(chunk),
            sample_ids=() if ghost else tuple(int(i) for i in ids), buffered_samples=len(self._samples),
            loader_wait_s=waited_s, rank_imbalance=plan.imbalance)
        self._step += 1
        st = self.stats
        st.steps += 1
        st.wait_s += waited_s
        st.buffered_max = max(st.buffered_max, len(self._samples))
        st.buffered_sum += len(self._samples)
        st.imbalance_sum += plan.imbalance
        st.imbalance_max = max(st.imbalance_max, plan.imbalance)
        st.ghost_steps += ghost
        st.samples += info.local_samples
        st.real_tokens += info.real_tokens
        st.padded_tokens += padded
        st.loss_tokens += local_loss
        batch = self._collate(samples)
        if self._finalize is not None:
            batch = self._finalize(batch)
        return attach_step_info(batch, info, self.cfg.step_info_key)

    def _scale(self, plan: StepPlan, chunk: List[StepPlan]) -> float:
        mode, w = self.cfg.loss_scaling, self.world_size
        if mode == "none":
            return 1.0
        if mode == "sample":
            total = sum(p.global_samples for p in chunk)
            return w * plan.local_samples / total if total else 0.0
        if mode == "approx":
            local_total = sum(p.local_loss_tokens for p in chunk)
            return plan.local_loss_tokens / local_total if local_total else 0.0
        total = sum(p.global_loss_tokens for p in chunk)
        return w * plan.local_loss_tokens / total if total else 0.0
