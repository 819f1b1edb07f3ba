"""Exact mid-epoch resume: the state of an epoch as plain data, and its restoration.

The state holds what cannot be recomputed cheaply: how many samples of the epoch's
sampler order were consumed, the ids of the samples already read but not yet emitted
(carried, planned, in the current optimizer step) with their arrival positions, the
planned steps' global summaries, and counters. Restoring re-reads only those samples
(map-style: by index, O(window); iterable datasets: by replaying the stream up to the
saved position) and skips the consumed prefix of the sampler order. Plain ints, lists
and strings only: loading never unpickles anything.

The loader plans ahead of the training loop, so the state of the batch the user has
consumed is not the producer's live state: every batch carries a ``Cursor`` (the state
taken after the last planned window and the steps emitted since), expanded on demand.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple

import numpy as np

from .align import StepPlan
from .stats import EpochStats

STATE_VERSION = 2
# Options that change which batches come out: a state saved under other values is refused.
PLAN_OPTIONS = ("token_budget", "window_budgets", "buffer_size", "first_window_size", "max_carry",
                "pack_efficiency", "pad_to_multiple_of", "max_batch_size", "batch_size_multiple", "quadratic_length",
                "max_image_patches", "oversize", "gradient_accumulation_steps", "join", "loss_scaling",
                "budget_schedule", "probe_worst_case", "layout")
TOP_KEYS = {"odb_state_version", "epoch", "seed", "world_size", "rank", "dataset_len", "iterable", "options",
            "run"}
RUN_KEYS = {"arrived", "planner", "planned_final", "all_done", "local_only", "window_index", "step", "positions", "carry",
            "pending", "chunk", "chunk_pos", "ghost", "stats"}


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where an epoch stands after one batch: the state after the last planned window, plus the
    steps emitted since and the counters then. Taking one costs O(1); ``cursor_state`` expands it."""

    snapshot: Dict[str, Any]
    since: int
    stats: EpochStats


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


def _retained(carry: List[int], rows: Iterable[List[Any]], ghost: Optional[int]) -> Set[int]:
    out = set(carry)
    for row in rows:
        if row[0] is not None:
            out.update(row[0])
    if ghost is not None:
        out.add(ghost)
    return out


def epoch_state(run: Any) -> Dict[str, Any]:
    """An EpochRun's position as plain data (between batches; O(samples held))."""
    # Micro-batches of the current optimizer step already emitted keep only their
    # summaries (the loss-scale denominator needs them), not their samples.
    chunk = [_step((plan, None) if k < run.chunk_pos else (plan, ids)) for k, (plan, ids) in enumerate(run.chunk)]
    pending = [_step(e) for e in run.pending]
    carry = [int(i) for i in run.planner.carried_ids]
    ghost = None if run.ghost is None else int(run.ghost[0])
    retained = _retained(carry, pending + chunk, ghost)
    positions = sorted([sid, run.pool.position(sid) if sid in run.pool else run.ghost[3]] for sid in retained)
    return {"arrived": run.arrived, "planner": run.planner.counters(), "planned_final": run.planned_final, "all_done": run.aligner.all_done,
            "local_only": run.aligner.local_only, "window_index": run.window_index, "step": run.step,
            "positions": positions, "carry": carry, "pending": pending, "chunk": chunk,
            "chunk_pos": run.chunk_pos, "ghost": ghost, "stats": dataclasses.asdict(run.stats)}


def cursor_state(cursor: Cursor, accumulation: int) -> Dict[str, Any]:
    """The epoch state once the cursor's batch was consumed: its snapshot advanced by the steps
    emitted since, as EpochRun forms optimizer steps (no window was planned in between)."""
    snap = cursor.snapshot
    chunk, pos, pending = list(snap["chunk"]), int(snap["chunk_pos"]), list(snap["pending"])
    for _ in range(cursor.since):
        if pos >= len(chunk):
            chunk, pending, pos = pending[:accumulation], pending[accumulation:], 0
        pos += 1
    chunk = [[None] + row[1:] if k < pos else row for k, row in enumerate(chunk)]
    retained = _retained(snap["carry"], pending + chunk, snap["ghost"])
    out = dict(snap)
    out.update(step=int(snap["step"]) + cursor.since, chunk=chunk, chunk_pos=pos, pending=pending,
               positions=[p for p in snap["positions"] if p[0] in retained], stats=dataclasses.asdict(cursor.stats))
    return out


def restore_epoch(run: Any, state: Dict[str, Any], samples: Dict[int, Tuple[Any, Any]]) -> None:
    """Continue an EpochRun from ``epoch_state``; ``samples`` maps every retained id to (sample, meta)."""
    for sid, position in state["positions"]:
        run.register(int(sid), samples[sid][0], samples[sid][1], int(position))
    carry = np.asarray(state["carry"], dtype=np.int64)
    if len(carry):
        run.planner.restore_carry(carry, run.pool.lengths(carry),
                                  run.pool.patches(carry) if run.cfg.image_patches_key else None)
    if state["ghost"] is not None:
        gid = int(state["ghost"])
        run.ghost = (gid, samples[gid][0], samples[gid][1], run.pool.position(gid))
    emitted = set(samples) - set(int(i) for i in carry)
    for row in state["pending"] + state["chunk"]:
        if row[0] is not None:
            emitted -= set(int(i) for i in row[0])
    run.pool.forget(emitted)  # only the ghost's sample: it was emitted for real before
    run.pending.extend(_unstep(r) for r in state["pending"])
    run.chunk = [_unstep(r) for r in state["chunk"]]
    run.chunk_pos = int(state["chunk_pos"])
    run.arrived = int(state["arrived"])
    run.planner.restore_counters(state["planner"])
    run.planned_final = bool(state["planned_final"])
    run.aligner.all_done = bool(state["all_done"])
    run.aligner.local_only = bool(state["local_only"]) or run.aligner.exchange is None
    run.window_index = int(state["window_index"])
    run.step = int(state["step"])
    stats = EpochStats(**state["stats"])
    for field in dataclasses.fields(EpochStats):  # the aligner shares the run's counters object
        setattr(run.stats, field.name, getattr(stats, field.name))


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
