"""What a planner answers for one pool of samples (shared by the padded and the packed planner).

Its own module so that ``odb.plan.windows.planner`` can hand the packed layout to ``odb.plan.windows.packing``
while both build the same answer: imports run one way (planner -> packing -> pool_plan).
"""

from __future__ import annotations

import dataclasses
from typing import List

import numpy as np


@dataclasses.dataclass(frozen=True)
class PoolPlan:
    """The planner's answer for one pool: positions into the pool (not sample ids).

    groups: positions into the pool, one array per batch, longest batch first.
    carry: positions to carry into the next window.
    oversize: positions of samples that alone exceed the budget (left to the policy).

    Example:
        >>> plan = PoolPlan([np.array([0, 1])], np.array([2]), np.empty(0, dtype=np.int64))
        >>> [g.tolist() for g in plan.groups], plan.carry.tolist()
        ([[0, 1]], [2])
    """

    groups: List[np.ndarray]
    carry: np.ndarray
    oversize: np.ndarray
