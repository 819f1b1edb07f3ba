"""The layout of an epoch run's state (``EpochRun.state_dict``): plain data, constant keys.

Planned steps are rows ``[sample positions or None (a ghost), global samples, global loss tokens,
local loss tokens, local samples, imbalance]``. ``odb.resume.state`` validates and versions the
whole loader state around it; the keys and rows here are the saved format (states saved by
earlier versions of odb load as they are).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from odb.epoch.stats import EpochStats
from odb.plan.align import StepPlan

RUN_KEYS = frozenset({"arrived", "planner", "planned_final", "all_done", "local_only", "window_index", "step",
                      "carry", "pending", "chunk", "chunk_pos", "ghost", "stats", "layers", "stream", "step_tokens"})


def step_row(entry: Tuple[StepPlan, Optional[np.ndarray]]) -> List[Any]:
    """A planned step as a row of plain data.

    Example:
        >>> step_row((StepPlan(0, 4, 9, 5, 2), np.array([7, 3])))
        [[7, 3], 4, 9, 5, 2, 1.0]
    """
    plan, ids = entry
    return [None if ids is None else np.asarray(ids, dtype=np.int64).tolist(), plan.global_samples,
            plan.global_loss_tokens, plan.local_loss_tokens, plan.local_samples, plan.imbalance]


def step_from_row(row: List[Any]) -> Tuple[StepPlan, Optional[np.ndarray]]:
    """The planned step of a row (``step_row``'s inverse, its group index 0 or None).

    Example:
        >>> plan, ids = step_from_row([[7, 3], 4, 9, 5, 2, 1.0])
        >>> plan.global_samples, ids.tolist()
        (4, [7, 3])
    """
    ids, global_samples, global_loss, local_loss, local_samples, imbalance = row
    group = None if ids is None else 0
    return (StepPlan(group, int(global_samples), int(global_loss), int(local_loss), int(local_samples),
                     float(imbalance)),
            None if ids is None else np.asarray(ids, dtype=np.int64))


def copy_row(row: List[Any]) -> List[Any]:
    """A row sharing nothing mutable with ``row``."""
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


def fresh_run_state(step: int, layers: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The state of an epoch that starts over an order of its own (``layers``) at step ``step``:
    what each rank continues from after a re-partition (odb.resume.elastic).

    Example:
        >>> state = fresh_run_state(5, [])
        >>> state["step"], state["carry"], set(state) == RUN_KEYS
        (5, [], True)
    """
    return {"arrived": 0, "planner": [0, 0, 0], "planned_final": False, "all_done": False, "local_only": False,
            "window_index": 0, "step": int(step), "carry": [], "pending": [], "chunk": [], "chunk_pos": 0,
            "ghost": None, "stats": dataclasses.asdict(EpochStats()), "layers": layers, "stream": None,
            "step_tokens": None}
