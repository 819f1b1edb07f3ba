"""The layout of an epoch run's state (``EpochRun.state_dict``): plain data, one part per unit.

``RUN_KEYS`` names the parts: ``position`` (the run's own place in the epoch: ``POSITION_KEYS``),
``planner`` (odb.plan.windows.window.WindowPlanner's), ``aligner`` (odb.epoch.ranks.RankAligner's),
``stats`` (odb.epoch.stats.EpochStats') and ``budget`` (the window budget's, odb.epoch.budget; None for a
fixed budget). Planned steps are rows ``[sample positions or None (a ghost), global samples, global loss
tokens, local loss tokens, local samples, imbalance]``. ``odb.resume.state`` validates and versions the
whole loader state around it, and upgrades states saved by earlier versions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Set, Tuple

import numpy as np

from odb.epoch.stats import EpochStats
from odb.plan.ranks.align import MicroBatchPlan

RUN_KEYS = frozenset({"position", "planner", "aligner", "stats", "budget"})
POSITION_KEYS = frozenset({"arrived", "planned_final", "window_index", "step", "optimizer_step", "pending", "micro",
                           "micro_pos", "ghost", "composed", "layers", "stream", "step_tokens"})


def step_row(entry: Tuple[MicroBatchPlan, Optional[np.ndarray]]) -> List[Any]:
    """A planned step as a row of plain data.

    Example:
        >>> step_row((MicroBatchPlan(0, 4, 9, 5, 2), np.array([7, 3])))
        [[7, 3], 4, 9, 5, 2, 1.0]
    """
    plan, ids = entry
    return [None if ids is None else np.asarray(ids, dtype=np.int64).tolist(), plan.global_samples,
            plan.global_loss_tokens, plan.local_loss_tokens, plan.local_samples, plan.imbalance]


def step_from_row(row: List[Any]) -> Tuple[MicroBatchPlan, Optional[np.ndarray]]:
    """The planned step of a row (``step_row``'s inverse, its group index 0 or None).

    Example:
        >>> plan, ids = step_from_row([[7, 3], 4, 9, 5, 2, 1.0])
        >>> plan.global_samples, ids.tolist()
        (4, [7, 3])
    """
    ids, global_samples, global_loss, local_loss, local_samples, imbalance = row
    group = None if ids is None else 0
    return (MicroBatchPlan(group, int(global_samples), int(global_loss), int(local_loss), int(local_samples),
                     float(imbalance)),
            None if ids is None else np.asarray(ids, dtype=np.int64))


def copy_row(row: List[Any]) -> List[Any]:
    """A row sharing nothing mutable with ``row``."""
    return [None if row[0] is None else list(row[0])] + row[1:]


def composed_positions(position: Dict[str, Any]) -> Set[int]:
    """Positions the step composer holds in a run state's ``position``: its composed steps not handed out yet
    (odb.epoch.composer).

    Example:
        >>> sorted(composed_positions({"composed": {"queued": [[5, 3], [8]], "blocks": 1, "ended": False}}))
        [3, 5, 8]
    """
    composed = position["composed"]
    return set() if composed is None else {int(i) for step in composed["queued"] for i in step}


def retained_positions(run: Dict[str, Any], ghost: bool = True, foreign: bool = False) -> Set[int]:
    """Positions of this rank's order a run state still holds: carried, composed into steps not planned yet, in
    planned steps not emitted yet, and the ghost's (``ghost=False``: not the ghost's, a copy rather than a
    sample still owed). ``foreign``: also the keys of samples planned here from other ranks (negative:
    odb.epoch.global_step.foreign_key).

    Example:
        >>> state = {"planner": {"carry": [9]}, "position": {"pending": [[[4, 2], 2, 9, 9, 2, 1.0]],
        ...          "micro": [[None, 1, 3, 3, 1, 1.0]], "ghost": 0, "composed": None}}
        >>> sorted(retained_positions(state)), sorted(retained_positions(state, ghost=False))
        ([0, 2, 4, 9], [2, 4, 9])
    """
    position = run["position"]
    out = {int(i) for i in run["planner"]["carry"]} | composed_positions(position)
    for row in list(position["pending"]) + list(position["micro"]):
        if row[0] is not None:
            out.update(int(i) for i in row[0])
    if ghost and position["ghost"] is not None:
        out.add(int(position["ghost"]))
    return out if foreign else {i for i in out if i >= 0}


def fresh_run_state(step: int, layers: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The state of an epoch that starts over an order of its own (``layers``) at step ``step``:
    what each rank continues from after a re-partition (odb.resume.elastic).

    Example:
        >>> state = fresh_run_state(5, [])
        >>> state["position"]["step"], state["planner"]["carry"], set(state) == RUN_KEYS
        (5, [], True)
    """
    position = {"arrived": 0, "planned_final": False, "window_index": 0, "step": int(step), "optimizer_step": 0,
                "pending": [],
                "micro": [], "micro_pos": 0, "ghost": None, "composed": None, "layers": layers, "stream": None,
                "step_tokens": None}
    return {"position": position, "planner": {"counts": [0, 0, 0], "carry": []},
            "aligner": {"all_done": False, "local_only": False}, "stats": dataclasses.asdict(EpochStats()),
            "budget": None}


def upgrade_run_v3(run: Dict[str, Any], window: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """A run state saved by version 3 (one flat namespace; ``window``: its token_budget="auto" window plans,
    saved beside it) in version 4's layout (``upgrade_run_v4`` goes on from there).

    Example:
        >>> position = {k: v for k, v in fresh_run_state(0, [])["position"].items() if not k.startswith("micro")}
        >>> old = dict(position, chunk=[], chunk_pos=0, planner=[1, 2, 1], carry=[4], all_done=False,
        ...            local_only=True, stats={})
        >>> new = upgrade_run_v4(upgrade_run_v3(old, None))
        >>> new["planner"], new["aligner"]["local_only"], set(new["position"]) == POSITION_KEYS
        ({'counts': [1, 2, 1], 'carry': [4]}, True, True)
    """
    position = {k: run[k] for k in POSITION_KEYS - {"micro", "micro_pos", "composed", "optimizer_step"}}
    position.update(micro=run["chunk"], micro_pos=run["chunk_pos"])
    return {"position": position, "planner": {"counts": run["planner"], "carry": run["carry"]},
            "aligner": {"all_done": run["all_done"], "local_only": run["local_only"]}, "stats": run["stats"],
            "budget": window}


def upgrade_run_v4(run: Dict[str, Any]) -> Dict[str, Any]:
    """A run state saved by version 4 in this version's layout: version 5 added the step composer's part of
    ``position`` (``composed``), which a version-4 run never had (its steps were the sampler's order), and the
    optimizer steps made (``optimizer_step``), which it did not count: its resumed epoch counts them from 0.

    Example:
        >>> upgrade_run_v4({"position": {"step": 3}, "planner": {}})["position"]
        {'step': 3, 'composed': None, 'optimizer_step': 0}
    """
    return dict(run, position=dict(run["position"], composed=None, optimizer_step=0))
