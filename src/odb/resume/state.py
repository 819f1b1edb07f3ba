"""Exact mid-epoch resume: the loader's state as plain data, versioned and validated.

Each stateful unit gives its own part (``state_dict`` / ``load_state_dict`` with constant keys),
nested under its name: the loader's budget (``budget``: token_budget="auto"'s memory model; None
for a fixed budget) and the epoch run (``run``: odb.epoch.run, its layout in odb.epoch.run_state),
which holds its own position and the window planner's, the rank aligner's, the counters' and the
window budget's parts. This module versions the whole state (``STATE_VERSION``, ``TOP_KEYS``),
upgrades states saved by earlier versions (``upgrade``), refuses states this loader cannot continue
(``check_state``) and expands a batch's ``Cursor`` into its state (``cursor_state``).

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
from typing import Any, Dict, Optional

from odb.epoch.cursor import Cursor
from odb.epoch.run_state import POSITION_KEYS, RUN_KEYS, copy_row, upgrade_run_v3, upgrade_run_v4

STATE_VERSION = 5  # 5: the step composer's part; 4: nested by unit (3: one flat namespace, "auto" beside it)
OLDEST_VERSION = 3  # the oldest saved state this version upgrades
TOP_KEYS = {"odb_state_version", "epoch", "seed", "world_size", "rank", "dataset_len", "iterable", "options",
            "sampler", "num_workers", "budget", "run"}


def upgrade(state: Any) -> Any:
    """A state saved by an earlier version (``OLDEST_VERSION`` on) in this version's layout (others as given:
    ``check_state`` names what is wrong with them).

    Example:
        >>> upgrade({"odb_state_version": 3, "epoch": 1, "run": None})
        {'odb_state_version': 5, 'epoch': 1, 'run': None, 'budget': None}
    """
    if not isinstance(state, dict) or state.get("odb_state_version") not in (3, 4):
        return state
    out = dict(state)
    if state["odb_state_version"] == 3:
        out = {k: v for k, v in state.items() if k != "auto"}
        auto = state.get("auto")
        window = auto.get("window") if auto is not None else None
        out["budget"] = None if auto is None else {k: v for k, v in auto.items() if k != "window"}
        if state.get("run") is not None:
            out["run"] = upgrade_run_v3(state["run"], window)
    if out.get("run") is not None:
        out["run"] = upgrade_run_v4(out["run"])
    if isinstance(out.get("options"), dict):  # saved before step compositions: its steps were the sampler's
        out["options"] = {"composition": "sampler", **out["options"]}
    out["odb_state_version"] = STATE_VERSION
    return out


def cursor_state(cursor: Cursor, accumulation: Optional[int]) -> Dict[str, Any]:
    """The epoch state once the cursor's batch was consumed: its snapshot advanced by the steps
    emitted since, as EpochRun forms optimizer steps (no window was planned in between):
    ``accumulation`` micro-batches each, or (None: ``global_batch_size``) all the planned ones.

    O(planned steps + samples held) list copies: the state shares nothing mutable with the loader."""
    snap = cursor.snapshot
    at = snap["position"]  # its "micro": the micro-batches of the optimizer step being emitted
    micro, pos, pending = at["micro"], int(at["micro_pos"]), at["pending"]
    optimizer_step = int(at["optimizer_step"])
    for _ in range(cursor.since):
        if pos >= len(micro):
            take = len(pending) if accumulation is None else accumulation
            micro, pending, pos = pending[:take], pending[take:], 0
        pos += 1
        optimizer_step += pos == len(micro)  # that batch was its optimizer step's last
    position = dict(at, step=int(at["step"]) + cursor.since, optimizer_step=optimizer_step, micro_pos=pos,
                    micro=[[None] + row[1:] if k < pos else copy_row(row) for k, row in enumerate(micro)],
                    pending=[copy_row(row) for row in pending],
                    composed=None if at["composed"] is None else dict(at["composed"], queued=[
                        list(step) for step in at["composed"]["queued"]]),
                    layers=[dict(layer, arrived=list(layer["arrived"]), kept=list(layer["kept"]))
                            for layer in at["layers"]],
                    step_tokens=list(cursor.step_tokens) if cursor.step_tokens is not None and pos < len(micro)
                    else None)
    planner = snap["planner"]
    budget = snap["budget"]
    return {"position": position, "planner": {"counts": list(planner["counts"]), "carry": list(planner["carry"])},
            "aligner": dict(snap["aligner"]), "stats": dict(vars(cursor.stats)),
            "budget": None if budget is None else copy.deepcopy(budget)}


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
        raise ValueError(f"odb state version {state.get('odb_state_version')!r}: this odb loads versions "
                         f"{OLDEST_VERSION} to {STATE_VERSION}. Fix: resume with the odb version that saved it.")
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
    if run is not None and (not isinstance(run, dict) or set(run) != RUN_KEYS or
                            not isinstance(run["position"], dict) or set(run["position"]) != POSITION_KEYS):
        shown = {k: sorted(v) if isinstance(v, dict) else v for k, v in run.items()} if isinstance(run, dict) else run
        raise ValueError(f"odb state 'run' holds {shown!r}, expected the parts {sorted(RUN_KEYS)} with 'position' "
                         f"{sorted(POSITION_KEYS)}. Fix: save it again with this odb version.")
