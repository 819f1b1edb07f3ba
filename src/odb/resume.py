"""Exact mid-epoch resume: the state of an epoch as plain data, and its restoration.

The state holds what cannot be recomputed cheaply: how many samples of the epoch's
sampler order were consumed, the ids of the samples already read but not yet emitted
(carried, planned, in the current optimizer step) with their arrival positions, the
planned steps' global summaries, and counters. Restoring re-reads only those samples
(map-style: by index, O(window); iterable datasets: by replaying the stream up to the
saved position) and skips the consumed prefix of the sampler order. Plain ints, lists
and strings only: loading never unpickles anything.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import numpy as np

from .align import StepPlan
from .stats import EpochStats

STATE_VERSION = 1
# Options that change which batches come out: a state saved under other values is refused.
PLAN_OPTIONS = ("token_budget", "buffer_size", "first_window_size", "max_carry", "pack_efficiency",
                "pad_to_multiple_of", "max_batch_size", "batch_size_multiple", "quadratic_length",
                "max_image_patches", "oversize", "gradient_accumulation_steps", "join", "loss_scaling",
                "budget_schedule", "probe_worst_case")
TOP_KEYS = {"odb_state_version", "epoch", "seed", "world_size", "rank", "dataset_len", "iterable", "options",
            "run"}
RUN_KEYS = {"arrived", "planned_final", "all_done", "local_only", "window_index", "step", "positions", "carry",
            "pending", "chunk", "chunk_pos", "ghost", "stats"}


def _step(entry: Tuple[StepPlan, Optional[np.ndarray]]) -> List[Any]:
    plan, ids = entry
    return [None if ids is None else [int(i) for i in ids], plan.global_samples, plan.global_loss_tokens,
            plan.local_loss_tokens, plan.local_samples, plan.imbalance]


def _unstep(row: List[Any]) -> Tuple[StepPlan, Optional[np.ndarray]]:
    ids, global_samples, global_loss, local_loss, local_samples, imbalance = row
    group = None if ids is None else 0
    return (StepPlan(group, int(global_samples), int(global_loss), int(local_loss), int(local_samples),
                     float(imbalance)),
            None if ids is None else np.asarray(ids, dtype=np.int64))


class ResumableRun:
    """The resume half of EpochRun (engine.py sets the attributes it uses)."""

    def run_state(self) -> Dict[str, Any]:
        """This epoch's position as plain data (call between batches)."""
        # Micro-batches of the current optimizer step already emitted keep only their
        # summaries (the loss-scale denominator needs them), not their samples.
        chunk = [(plan, None) if k < self._chunk_pos else (plan, ids) for k, (plan, ids) in enumerate(self._chunk)]
        steps = list(self._pending) + chunk
        retained: Set[int] = {int(i) for i in self.planner.carried_ids}
        for _, ids in steps:
            if ids is not None:
                retained.update(int(i) for i in ids)
        ghost = None if self._ghost is None else int(self._ghost[0])
        if ghost is not None:
            retained.add(ghost)
        positions = sorted([sid, self._ghost[2].position if sid == ghost and sid not in self._meta
                            else self._meta[sid].position] for sid in retained)
        return {"arrived": self._arrived, "planned_final": self._planned_final, "all_done": self._all_done,
                "local_only": self._local_only, "window_index": self._window_index, "step": self._step,
                "positions": positions, "carry": [int(i) for i in self.planner.carried_ids],
                "pending": [_step(e) for e in self._pending], "chunk": [_step(e) for e in chunk],
                "chunk_pos": self._chunk_pos, "ghost": ghost, "stats": dataclasses.asdict(self.stats)}

    def restore(self, state: Dict[str, Any], samples: Dict[int, Any]) -> None:
        """Continue from ``run_state()``; ``samples`` maps every retained id to its sample."""
        for sid, position in state["positions"]:
            self._arrived = position
            self._register(sid, samples[sid])
        carry = np.asarray(state["carry"], dtype=np.int64)
        metas = [self._meta[int(i)] for i in carry]
        if len(carry):
            self.planner.restore_carry(carry, np.array([m.lengths for m in metas], dtype=np.int64),
                                       np.array([m.patches for m in metas]) if self.cfg.image_patches_key else None)
        if state["ghost"] is not None:
            gid = int(state["ghost"])
            self._ghost = (gid, samples[gid], self._meta[gid])
        emitted = set(samples) - set(int(i) for i in carry)
        for _, ids in (_unstep(r) for r in state["pending"] + state["chunk"]):
            if ids is not None:
                emitted -= set(int(i) for i in ids)
        for sid in emitted:  # only the ghost's sample: it was emitted for real before
            self._samples.pop(sid, None)
            self._meta.pop(sid, None)
        self._pending.extend(_unstep(r) for r in state["pending"])
        self._chunk = [_unstep(r) for r in state["chunk"]]
        self._chunk_pos = int(state["chunk_pos"])
        self._arrived = int(state["arrived"])
        self._planned_final = self._exhausted = bool(state["planned_final"])
        self._all_done = bool(state["all_done"])
        self._local_only = bool(state["local_only"]) or self._exchange is None
        self._window_index = int(state["window_index"])
        self._step = int(state["step"])
        self.stats = EpochStats(**state["stats"])


def check_state(state: Any, *, world_size: int, rank: int, dataset_len: Optional[int], iterable: bool,
                options: Dict[str, Any]) -> None:
    """Refuse a state that this loader cannot continue exactly (strict, with the fix)."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict got {type(state).__name__}: odb states are dicts from "
                        f"loader.state_dict(). Fix: pass that dict (e.g. json.load of what you saved).")
    unknown, missing = set(state) - TOP_KEYS, TOP_KEYS - set(state)
    if unknown or missing:
        raise ValueError(f"odb state has unknown keys {sorted(unknown)} / lacks {sorted(missing)}: it was not "
                         f"made by loader.state_dict() of this odb version. Fix: save it again with this version.")
    if state["odb_state_version"] != STATE_VERSION:
        raise ValueError(f"odb state version {state['odb_state_version']!r} is not {STATE_VERSION}. "
                         f"Fix: resume with the odb version that saved it.")
    if state["world_size"] != world_size or state["rank"] != rank:
        raise ValueError(f"odb state was saved by rank {state['rank']} of {state['world_size']}, this is rank "
                         f"{rank} of {world_size}: batches are planned per rank, so re-partitioning to another "
                         f"world size is not supported. Fix: resume with the same world size, each rank loading "
                         f"its own state.")
    if state["dataset_len"] != dataset_len or state["iterable"] != iterable:
        raise ValueError(f"odb state was saved for a dataset of length {state['dataset_len']} "
                         f"(iterable={state['iterable']}), this loader has {dataset_len} (iterable={iterable}). "
                         f"Fix: resume over the same dataset.")
    changed = {k: (v, options.get(k)) for k, v in state["options"].items() if options.get(k) != v}
    if changed:
        raise ValueError(f"odb state was planned with other options {changed} (saved, now): the remaining batches "
                         f"would differ. Fix: build the loader with the saved options.")
    run = state["run"]
    if run is not None and set(run) != RUN_KEYS:
        raise ValueError(f"odb state 'run' has keys {sorted(run)}, expected {sorted(RUN_KEYS)}. "
                         f"Fix: save it again with this odb version.")


def retained_ids(run: Dict[str, Any]) -> List[int]:
    return [int(sid) for sid, _ in run["positions"]]


def skip_stream(stream: Iterable[List[Tuple[int, Any]]], arrived: int, wanted: Set[int]
                ) -> Tuple[Dict[int, Any], Iterator[List[Tuple[int, Any]]]]:
    """Replay an (id, sample) chunk stream up to ``arrived``, keeping the wanted samples."""
    it = iter(stream)
    found: Dict[int, Any] = {}
    first: List[Tuple[int, Any]] = []
    for chunk in it:
        for sid, sample in chunk:
            if sid < arrived:
                if sid in wanted:
                    found[sid] = sample
            else:
                first.append((sid, sample))
        if first:
            break
    missing = wanted - set(found)
    if missing:
        raise ValueError(f"odb resume: the dataset stream ended before samples {sorted(missing)[:5]} reappeared: "
                         f"the IterableDataset does not replay the same stream. Fix: make its order deterministic "
                         f"(seeded) so it can be resumed.")

    def rest() -> Iterator[List[Tuple[int, Any]]]:
        if first:
            yield first
        yield from it

    return found, rest()
