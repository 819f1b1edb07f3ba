"""Exact mid-epoch resume: the state of an epoch as plain data, and its restoration.

Samples are named by their position in the epoch's order (odb.data.sampling), so samplers may
repeat dataset indices. The state holds what cannot be recomputed cheaply: how many
positions of the epoch's order were consumed, the positions read but not yet emitted
(carried, planned, in the current optimizer step, the ghost's), the planned steps' global
summaries, and counters; when the epoch was re-partitioned over another number of ranks,
how (``layers``, odb.resume.elastic); for an IterableDataset with its own state, the point its
stream restarts from (``stream``, odb.data.stream_state). Restoring re-reads only the retained
samples (map-style: by index, O(window); iterable datasets: from the stream's restart point,
or by replaying the stream) and skips the consumed prefix of the order. Plain ints, floats,
bools, strings, lists and dicts only: the state passes through JSON and
``torch.load(weights_only=True)``, and loading never unpickles anything.

The loader plans ahead of the training loop, so the state of the batch the user has
consumed is not the producer's live state: every batch carries a ``Cursor`` (the state
taken after the last planned window and the steps emitted since), expanded on demand in
O(planned steps), so trainers can save it every step.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from odb.config import PLAN_OPTIONS  # noqa: F401  (validated here; odb.resume.loader_state reads it)
from odb.epoch.cursor import Cursor
from odb.epoch.stats import EpochStats
from odb.plan.align import StepPlan

STATE_VERSION = 3
TOP_KEYS = {"odb_state_version", "epoch", "seed", "world_size", "rank", "dataset_len", "iterable", "options",
            "sampler", "num_workers", "run"}
RUN_KEYS = {"arrived", "planner", "planned_final", "all_done", "local_only", "window_index", "step", "carry",
            "pending", "chunk", "chunk_pos", "ghost", "stats", "layers", "stream", "step_tokens"}


def _step(entry: Tuple[StepPlan, Optional[np.ndarray]]) -> List[Any]:
    plan, ids = entry
    return [None if ids is None else np.asarray(ids, dtype=np.int64).tolist(), plan.global_samples,
            plan.global_loss_tokens, plan.local_loss_tokens, plan.local_samples, plan.imbalance]


def _unstep(row: List[Any]) -> Tuple[StepPlan, Optional[np.ndarray]]:
    ids, global_samples, global_loss, local_loss, local_samples, imbalance = row
    group = None if ids is None else 0
    return (StepPlan(group, int(global_samples), int(global_loss), int(local_loss), int(local_samples),
                     float(imbalance)),
            None if ids is None else np.asarray(ids, dtype=np.int64))


def _copy_row(row: List[Any]) -> List[Any]:
    return [None if row[0] is None else list(row[0])] + row[1:]


def retained_positions(run: Dict[str, Any]) -> Set[int]:
    """Positions a run state still holds: carried, in planned steps not emitted yet, and the ghost's.

    Example:
        >>> sorted(retained_positions({"carry": [9], "pending": [[[4, 2], 2, 9, 9, 2, 1.0]],
        ...                            "chunk": [[None, 1, 3, 3, 1, 1.0]], "ghost": 0}))
        [0, 2, 4, 9]
    """
    out = {int(i) for i in run["carry"]}
    for row in list(run["pending"]) + list(run["chunk"]):
        if row[0] is not None:
            out.update(int(i) for i in row[0])
    if run["ghost"] is not None:
        out.add(int(run["ghost"]))
    return out


def epoch_state(run: Any) -> Dict[str, Any]:
    """An EpochRun's position as plain data (between batches; O(samples held))."""
    # Micro-batches of the current optimizer step already emitted keep only their
    # summaries (the loss-scale denominator needs them), not their samples.
    chunk = [_step((plan, None) if k < run.chunk_pos else (plan, ids)) for k, (plan, ids) in enumerate(run.chunk)]
    state = {"arrived": run.arrived, "planner": run.planner.counters(), "planned_final": run.planned_final,
             "all_done": run.aligner.all_done, "local_only": run.aligner.local_only,
             "window_index": run.window_index, "step": run.step, "carry": run.planner.carried_ids.tolist(),
             "pending": [_step(e) for e in run.pending], "chunk": chunk, "chunk_pos": run.chunk_pos,
             "ghost": None if run.ghost is None else int(run.ghost[0]), "stats": dataclasses.asdict(run.stats),
             "layers": run.layers, "stream": None, "step_tokens": None}
    if run.stream_marks is not None:  # the latest restart point of the stream before every retained sample
        state["stream"] = run.stream_marks.cut(min(retained_positions(state), default=run.arrived))
    return state


def cursor_state(cursor: Cursor, accumulation: int) -> Dict[str, Any]:
    """The epoch state once the cursor's batch was consumed: its snapshot advanced by the steps
    emitted since, as EpochRun forms optimizer steps (no window was planned in between).

    O(planned steps + samples held) list copies: the state shares nothing mutable with the loader."""
    snap = cursor.snapshot
    chunk, pos, pending = snap["chunk"], int(snap["chunk_pos"]), snap["pending"]
    for _ in range(cursor.since):
        if pos >= len(chunk):
            chunk, pending, pos = pending[:accumulation], pending[accumulation:], 0
        pos += 1
    out = dict(snap)
    out.update(step=int(snap["step"]) + cursor.since, chunk_pos=pos, carry=list(snap["carry"]),
               chunk=[[None] + row[1:] if k < pos else _copy_row(row) for k, row in enumerate(chunk)],
               pending=[_copy_row(row) for row in pending], stats=dict(vars(cursor.stats)),
               planner=list(snap["planner"]),
               layers=[dict(layer, arrived=list(layer["arrived"]), kept=list(layer["kept"]))
                       for layer in snap["layers"]],
               step_tokens=list(cursor.step_tokens) if cursor.step_tokens is not None and pos < len(chunk) else None)
    return out


def restore_epoch(run: Any, state: Dict[str, Any], samples: Dict[int, Tuple[int, Any, Any]]) -> None:
    """Continue an EpochRun from ``epoch_state``; ``samples`` maps every retained position to
    (dataset index, sample, meta)."""
    for sid in sorted(retained_positions(state)):
        index, sample, meta = samples[sid]
        run.register(sid, int(index), sample, meta)
    carry = np.asarray(state["carry"], dtype=np.int64)
    if len(carry):
        run.planner.restore_carry(carry, run.pool.lengths(carry),
                                  run.pool.patches(carry) if run.cfg.image_patches_key else None)
    if state["ghost"] is not None:
        gid = int(state["ghost"])
        index, sample, meta = samples[gid]
        run.ghost = (gid, copy.deepcopy(sample), meta, int(index))  # the pool may emit the same sample
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
    run.layers = [dict(layer) for layer in state["layers"]]
    stats = EpochStats(**state["stats"])
    for field in dataclasses.fields(EpochStats):  # the aligner shares the run's counters object
        setattr(run.stats, field.name, getattr(stats, field.name))


def fresh_run_state(step: int, layers: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The state of an epoch that starts over an order of its own (``layers``) at step ``step``:
    what each rank continues from after a re-partition (odb.resume.elastic)."""
    return {"arrived": 0, "planner": [0, 0, 0], "planned_final": False, "all_done": False, "local_only": False,
            "window_index": 0, "step": int(step), "carry": [], "pending": [], "chunk": [], "chunk_pos": 0,
            "ghost": None, "stats": dataclasses.asdict(EpochStats()), "layers": layers, "stream": None,
            "step_tokens": None}


def check_state(state: Any, *, world_size: int, rank: int, dataset_len: Optional[int], iterable: bool,
                options: Dict[str, Any], sampler: Optional[Dict[str, Any]] = None, num_workers: int = 0,
                any_rank: bool = False) -> None:
    """Refuse a state that this loader cannot continue exactly (strict, with the fix).

    ``any_rank``: the state is one of every rank's states for a re-partition (odb.resume.elastic),
    so its world size and rank need not be this process's."""
    if not isinstance(state, dict):
        raise TypeError(f"load_state_dict got {type(state).__name__}: odb states are dicts from "
                        f"loader.state_dict() (or a list of every rank's). Fix: pass that dict (e.g. json.load or "
                        f"torch.load of what you saved).")
    unknown, missing = set(state) - TOP_KEYS, TOP_KEYS - set(state)
    if state.get("odb_state_version") != STATE_VERSION:
        raise ValueError(f"odb state version {state.get('odb_state_version')!r} is not {STATE_VERSION}. "
                         f"Fix: resume with the odb version that saved it.")
    if unknown or missing:
        raise ValueError(f"odb state has unknown keys {sorted(unknown)} / lacks {sorted(missing)}: it was not "
                         f"made by loader.state_dict() of this odb version. Fix: save it again with this version.")
    if not any_rank and (state["world_size"] != world_size or state["rank"] != rank):
        raise ValueError(f"odb state was saved by rank {state['rank']} of world size {state['world_size']}, this "
                         f"is rank {rank} of {world_size}. Rule: one rank's state resumes that same rank; another "
                         f"world size needs every rank's state. Fix: resume with {state['world_size']} rank(s), each "
                         f"loading its own state, or pass the list of all {state['world_size']} ranks' states "
                         f"(load_state_dict([state_of_rank_0, ...])) to re-partition the epoch over {world_size}.")
    if state["dataset_len"] != dataset_len or state["iterable"] != iterable:
        raise ValueError(f"odb state was saved for a dataset of length {state['dataset_len']} "
                         f"(iterable={state['iterable']}), this loader has {dataset_len} (iterable={iterable}). "
                         f"Fix: resume over the same dataset.")
    changed = {k: (v, options.get(k)) for k, v in state["options"].items() if options.get(k) != v}
    if changed:
        raise ValueError(f"odb state was planned with other options {changed} (saved, now): the remaining batches "
                         f"would differ. Fix: build the loader with the saved options.")
    if state["sampler"] != sampler:
        raise ValueError(f"odb state was saved with sampler {state['sampler']}, this loader has {sampler}: the "
                         f"positions in the state would name other samples. Fix: build the loader with the saved "
                         f"sampler class and settings (seed, shuffle, drop_last).")
    if iterable and state["num_workers"] != num_workers:
        raise ValueError(f"odb state of an IterableDataset was saved with num_workers={state['num_workers']}, this "
                         f"loader has num_workers={num_workers}. Rule: the stream's order (and its own state, per "
                         f"worker) depends on how the workers split it. Fix: resume with "
                         f"num_workers={state['num_workers']} (map-style datasets may change it).")
    run = state["run"]
    if run is not None and (not isinstance(run, dict) or set(run) != RUN_KEYS):
        raise ValueError(f"odb state 'run' has keys {sorted(run) if isinstance(run, dict) else run!r}, expected "
                         f"{sorted(RUN_KEYS)}. Fix: save it again with this odb version.")
