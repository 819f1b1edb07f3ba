"""The planner's settings for one window of ``token_budget="auto"`` (``BudgetPlan``), and how several
ranks' plans agree (``agree``): the most conservative of them (pure numpy).

A plan is what ``odb.plan.auto.auto_budget.AutoBudget`` maps its fitted memory model onto: a token
budget, a quadratic length, and the tokens-equivalent a sample, a supervised token and an image
patch add to a batch's cost (``odb.plan.costs.cost.CostModel``). It travels between ranks as
``PLAN_FIELDS`` int64 (``encode``): the costs in thousandths, rounded up.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence, Union

import numpy as np

from odb.plan.costs.cost import CostModel

MAX_BUDGET = 2 ** 40  # no budget, quadratic length or cost beyond this (int64-safe, float-exact)
MILLI = 1000
PLAN_FIELDS = 5  # int64 of an encoded plan: budget, quadratic length, sample, supervised-token and patch costs


def ceil_milli(x: float) -> float:
    """x rounded up to a thousandth (a hair of float error forgiven).

    Example:
        >>> ceil_milli(0.0101), ceil_milli(2.0)
        (0.011, 2.0)
    """
    return math.ceil(x * MILLI - 1e-6) / MILLI


def _milli(x: float) -> int:
    return math.ceil(x * MILLI - 1e-6)


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """The planner's settings for one window: ``token_budget``, ``quadratic_length`` (None: no
    quadratic term), ``sample_cost`` (tokens-equivalent per sample), ``loss_token_cost`` (per
    supervised token) and ``image_patch_cost`` (per image patch), each cost a multiple of 1/1000.

    Example:
        >>> p = BudgetPlan(4096, 2048, 12.5, 0.25, 0.5)
        >>> p.encode().tolist(), BudgetPlan.decode(p.encode()) == p
        ([4096, 2048, 12500, 250, 500], True)
        >>> p.cost_model().batch_cost(np.array([[100], [100]]))   # 2 x (100 + 100**2 / 2048 + 12.5)
        234.765625
        >>> p.cost_model().batch_cost(np.array([[100], [100]]), np.array([[0, 40], [8, 60]]))  # + 0.25 x 100 + 0.5 x 8
        263.765625
    """

    token_budget: int
    quadratic_length: Optional[int] = None
    sample_cost: float = 0.0
    loss_token_cost: float = 0.0
    image_patch_cost: float = 0.0

    def __post_init__(self) -> None:
        q = self.quadratic_length
        costs = (self.sample_cost, self.loss_token_cost, self.image_patch_cost)
        if int(self.token_budget) < 1 or (q is not None and int(q) < 1) or not all(0 <= c < math.inf for c in costs):
            raise ValueError(
                f"BudgetPlan(token_budget={self.token_budget!r}, quadratic_length={q!r}, sample_cost="
                f"{self.sample_cost!r}, loss_token_cost={self.loss_token_cost!r}, image_patch_cost="
                f"{self.image_patch_cost!r}): the budget and quadratic length must be ints >= 1 (or quadratic_length "
                f"None) and the costs finite floats >= 0. Fix: pass such values.")

    def encode(self) -> np.ndarray:
        """(PLAN_FIELDS,) int64: budget, quadratic length (0 for None), then the sample, supervised-token and
        patch costs in thousandths rounded up."""
        q = 0 if self.quadratic_length is None else int(self.quadratic_length)
        return np.array([int(self.token_budget), q, _milli(self.sample_cost), _milli(self.loss_token_cost),
                         _milli(self.image_patch_cost)], dtype=np.int64)

    @staticmethod
    def decode(values: Any) -> "BudgetPlan":
        """The plan ``encode`` wrote (3 values, as saved before the supervised-token and patch costs: those 0).

        Example:
            >>> BudgetPlan.decode([100, 0, 1])
            BudgetPlan(token_budget=100, quadratic_length=None, sample_cost=0.001, loss_token_cost=0.0, image_patch_cost=0.0)
        """
        v = np.asarray(values, dtype=np.int64).ravel()
        if v.shape == (3,):
            v = np.concatenate((v, np.zeros(PLAN_FIELDS - 3, dtype=np.int64)))
        if v.shape != (PLAN_FIELDS,):
            raise ValueError(
                f"encoded budget plan {v.tolist()}: a plan encodes as {PLAN_FIELDS} int64 (budget, quadratic length "
                f"or 0, then the sample, supervised-token and patch costs in thousandths). Fix: pass "
                f"BudgetPlan.encode()'s output.")
        return BudgetPlan(int(v[0]), None if v[1] == 0 else int(v[1]), int(v[2]) / MILLI, int(v[3]) / MILLI,
                          int(v[4]) / MILLI)

    def cost_model(self, **kwargs: Any) -> CostModel:
        """The CostModel of this plan (further CostModel keywords, e.g. ``layout="packed"``, pass through)."""
        return CostModel((int(self.token_budget),), quadratic_length=self.quadratic_length,
                         sample_cost=self.sample_cost, loss_token_cost=self.loss_token_cost,
                         image_patch_cost=self.image_patch_cost, **kwargs)


def agree(plans: Union[Sequence[BudgetPlan], np.ndarray]) -> BudgetPlan:
    """The most conservative plan of several ranks': the least budget, the least quadratic length
    (None counts as infinite), the largest of each cost. Takes BudgetPlans or their (n, PLAN_FIELDS)
    encodings.

    Example:
        >>> agree([BudgetPlan(900, None, 0.5), BudgetPlan(1000, 300, 0.25, 2.0)])
        BudgetPlan(token_budget=900, quadratic_length=300, sample_cost=0.5, loss_token_cost=2.0, image_patch_cost=0.0)
        >>> agree(np.array([[900, 0, 500, 0, 0], [1000, 0, 250, 0, 125]])).image_patch_cost
        0.125
    """
    if isinstance(plans, np.ndarray):
        arr = plans.reshape(-1, PLAN_FIELDS).astype(np.int64)
    else:
        arr = np.array([p.encode() for p in plans], dtype=np.int64).reshape(-1, PLAN_FIELDS)
    if len(arr) == 0:
        raise ValueError("agree() got no plans: it needs every rank's plan (at least one). "
                         "Fix: pass the plans gathered from all ranks.")
    qs = arr[:, 1][arr[:, 1] > 0]
    top = arr[:, 2:].max(axis=0)
    return BudgetPlan(int(arr[:, 0].min()), int(qs.min()) if len(qs) else None, int(top[0]) / MILLI,
                      int(top[1]) / MILLI, int(top[2]) / MILLI)


def plan_of_coefficients(a: float, b: float, c: float, e: float, f: float, room: float,
                         min_budget: int) -> BudgetPlan:
    """The exact mapping of a linear memory bound ``a tokens + b square_tokens + c samples + e supervised
    + f patches <= room`` onto a plan: ``a_eff = max(a, b, room / MAX_BUDGET)``, budget ``room / a_eff``,
    q ``a_eff / b``, and each cost ``/ a_eff``; each rounding errs on the safe side.

    Example:
        >>> plan_of_coefficients(100.0, 0.5, 1000.0, 800.0, 50.0, 7e5, 1)
        BudgetPlan(token_budget=7000, quadratic_length=200, sample_cost=10.0, loss_token_cost=8.0, image_patch_cost=0.5)
    """
    if room <= 0:
        return BudgetPlan(min_budget, 1, 0.0)
    a_eff = max(a, b, room / MAX_BUDGET)  # >= a: conservative; >= b: q >= 1
    budget = int(min(math.floor(room / a_eff), MAX_BUDGET))
    q = None if b <= 0 or a_eff / b > MAX_BUDGET else max(1, int(math.floor(a_eff / b)))
    costs = [min(ceil_milli(v / a_eff), float(MAX_BUDGET)) for v in (c, e, f)]
    return BudgetPlan(max(min_budget, budget), q, *costs)
