"""How good a planned step is: its DDP and FSDP efficiency, the ideal step time over the planned one
(``step_efficiency``)."""

from __future__ import annotations

from typing import Tuple

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.steps.global_plan.result import GlobalStepPlan


def step_efficiency(lengths: np.ndarray, plan: GlobalStepPlan, cost: CostModel, overhead: float
                    ) -> Tuple[float, float]:
    """(DDP, FSDP) efficiency of a planned step: the ideal step time over the planned one, in tokens.

    Ideal: the step's real tokens (of the planned samples) spread evenly over the W ranks, in one micro-batch
    each: ``real / W + overhead``. DDP waits for the slowest rank at the step's all-reduce:
    ``max over ranks r of (sum over j of padded(r, j)) + M x overhead``. FSDP meets at every micro-step:
    ``sum over j of max over r of (padded(r, j) + overhead)``. ``padded(r, j)`` is ``cost.group_tokens`` of rank
    r's micro-batch j (B x its longest per dimension; packed: its real tokens), 0 for a ghost (which costs the
    overhead only). A plan with no micro-batch scores (1.0, 1.0).

    Example:
        >>> cost = CostModel((100,))
        >>> plan = GlobalStepPlan([[np.array([0]), np.array([2, 3])], [np.array([1]), np.empty(0, dtype=np.int64)]],
        ...                       np.empty(0, dtype=np.int64), np.zeros(2), 0.0)
        >>> step_efficiency(np.array([40, 30, 10, 5]), plan, cost, overhead=10.0)   # (85/2+10) / (60+20), / (50+20+10)
        (0.65625, 0.65625)
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim == 1:
        lengths = lengths[:, None]
    world, m = len(plan.ranks), plan.micro_steps
    if world == 0 or m == 0:
        return 1.0, 1.0
    padded = np.zeros((world, m))
    real = 0
    for r, groups in enumerate(plan.ranks):
        for j, g in enumerate(groups):
            if len(g):
                padded[r, j] = cost.group_tokens(lengths[g])
                real += int(lengths[g].sum())
    ideal = real / world + overhead
    ddp = ideal / (float(padded.sum(axis=1).max()) + m * overhead)
    fsdp = ideal / float((padded + overhead).max(axis=0).sum())
    return float(ddp), float(fsdp)
