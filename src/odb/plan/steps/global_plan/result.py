"""The planned step (``GlobalStepPlan``) and the one empty array every ghost micro-batch shares."""

from __future__ import annotations

import dataclasses
from typing import List

import numpy as np

from odb.plan.steps.step_plan import OptimizerStepPlan

_EMPTY = np.empty(0, dtype=np.int64)
_EMPTY.flags.writeable = False  # the one ghost array every plan shares


@dataclasses.dataclass(frozen=True)
class GlobalStepPlan(OptimizerStepPlan):
    """One step planned over W ranks: positions into the step's samples (``OptimizerStepPlan``), with what the
    loader's planner adds.

    ranks: ``ranks[r][j]`` the positions of rank r's micro-batch j; every rank has ``micro_steps`` of them;
        an empty array is a ghost micro-batch (the rank runs an empty forward for that micro-step).
    oversize: positions of samples that alone exceed the budget, not planned (the caller's oversize policy
        decides); empty when the plan was asked to give them micro-batches of their own (``alone``).
    rank_costs: (W,) each rank's cost: the sum over its micro-batches of ``cost.group_cost`` of its samples
        plus ``overhead``, a ghost costing ``overhead`` alone.
    bound: a lower bound on ``rank_costs.max()`` of any plan of these samples (see ``plan_global_step``).

    Example:
        >>> plan = GlobalStepPlan([[np.array([0]), np.array([2])], [np.array([1]), np.empty(0, dtype=np.int64)]],
        ...                       np.empty(0, dtype=np.int64), np.array([30.0, 20.0]), 25.0)
        >>> plan.micro_steps, plan.ghosts
        (2, 1)
    """

    oversize: np.ndarray
    rank_costs: np.ndarray
    bound: float
