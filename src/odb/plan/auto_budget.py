"""``token_budget="auto"``: the planner's settings from a memory model fitted on the run (pure numpy).

``AutoBudget`` fits two ``StepModel``\\ s online, the peak memory of a step and its seconds,
each ``a * tokens + b * square_tokens + c * samples + d`` of the batch's shape
(``odb.plan.step_model``). Each window it proposes the planner's settings (``BudgetPlan``)
so that every batch the planner accepts stays, by the memory model's *upper* bound, under
``(1 - margin)`` x the memory cap. With C' that share of the cap (less the constant d), a
padded batch of B samples of longest length L fits when::

    B * (a L + b L^2 + c) + d <= C'   <=>   B * (L + L^2 / q + c / a) <= (C' - d) / a,   q = a / b

which is exactly ``CostModel((token_budget,), quadratic_length=q, sample_cost=s)`` with
``token_budget = floor((C' - d) / a)``, ``q = floor(a / b)`` (None when b is 0) and
``s = c / a`` rounded up to a thousandth: each rounding errs on the safe side. Packed rows
(the sum over their samples) map the same way.

Before the memory model is fitted (a few steps of varied shapes) the proposal is the start
budget, grown by at most ``growth`` per proposal, and to no more than the budget at which the
costliest batch per token observed since the last proposal would reach the usable cap. Once
fitted, the proposal is the model's: the largest budget whose batches of the lengths the run
has shown stay under the usable cap by the full upper bound,
which adds the coefficients' uncertainty: a noiseless fit jumps to its budget at once, a
noisy one far from the shapes it measured extrapolates no further than its standard errors
allow. An out-of-memory step lowers the effective cap below that batch's prediction and
shrinks the next proposal to at most 0.9 x the last. Under several
ranks each sends its plan (``BudgetPlan.encode``, three int64) in the per-window exchange and
all plan with ``agree``: the most conservative of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from odb.plan.cost import CostModel
from odb.plan.step_model import StepModel, shape_features

_MAX_BUDGET = 2 ** 40  # no budget, quadratic length or sample cost beyond this (int64-safe, float-exact)
_MILLI = 1000
_STATE_KEYS = ("version", "cap", "effective_cap", "packed", "margin", "growth", "min_budget", "budget", "last",
               "window_rate", "oom_pending", "ooms", "memory", "time")


def _ceil_milli(x: float) -> float:
    """x rounded up to a thousandth (a hair of float error forgiven)."""
    return math.ceil(x * _MILLI - 1e-6) / _MILLI


@dataclasses.dataclass(frozen=True)
class BudgetPlan:
    """The planner's settings for one window: ``token_budget``, ``quadratic_length`` (None: no
    quadratic term), ``sample_cost`` (tokens-equivalent per sample, a multiple of 1/1000).

    Example:
        >>> p = BudgetPlan(4096, 2048, 12.5)
        >>> p.encode().tolist(), BudgetPlan.decode(p.encode()) == p
        ([4096, 2048, 12500], True)
        >>> p.cost_model().batch_cost(np.array([[100], [100]]))   # 2 x (100 + 100**2 / 2048 + 12.5)
        234.765625
    """

    token_budget: int
    quadratic_length: Optional[int] = None
    sample_cost: float = 0.0

    def __post_init__(self) -> None:
        q = self.quadratic_length
        if int(self.token_budget) < 1 or (q is not None and int(q) < 1) or not (0 <= self.sample_cost < math.inf):
            raise ValueError(
                f"BudgetPlan(token_budget={self.token_budget!r}, quadratic_length={q!r}, "
                f"sample_cost={self.sample_cost!r}): the budget and quadratic length must be ints >= 1 (or "
                f"quadratic_length None) and sample_cost a finite float >= 0. Fix: pass such values.")

    def encode(self) -> np.ndarray:
        """(3,) int64: budget, quadratic length (0 for None), sample cost in thousandths rounded up."""
        q = 0 if self.quadratic_length is None else int(self.quadratic_length)
        return np.array([int(self.token_budget), q, math.ceil(self.sample_cost * _MILLI - 1e-6)], dtype=np.int64)

    @staticmethod
    def decode(values: Any) -> "BudgetPlan":
        """The plan ``encode`` wrote.

        Example:
            >>> BudgetPlan.decode([100, 0, 1])
            BudgetPlan(token_budget=100, quadratic_length=None, sample_cost=0.001)
        """
        v = np.asarray(values, dtype=np.int64).ravel()
        if v.shape != (3,):
            raise ValueError(
                f"encoded budget plan {v.tolist()}: a plan encodes as 3 int64 (budget, quadratic length or 0, "
                f"sample cost in thousandths). Fix: pass BudgetPlan.encode()'s output.")
        return BudgetPlan(int(v[0]), None if v[1] == 0 else int(v[1]), int(v[2]) / _MILLI)

    def cost_model(self, **kwargs: Any) -> CostModel:
        """The CostModel of this plan (further CostModel keywords, e.g. ``layout="packed"``, pass through)."""
        return CostModel((int(self.token_budget),), quadratic_length=self.quadratic_length,
                         sample_cost=self.sample_cost, **kwargs)


def agree(plans: Union[Sequence[BudgetPlan], np.ndarray]) -> BudgetPlan:
    """The most conservative plan of several ranks': the least budget, the least quadratic length
    (None counts as infinite), the largest sample cost. Takes BudgetPlans or their (n, 3) encodings.

    Example:
        >>> agree([BudgetPlan(900, None, 0.5), BudgetPlan(1000, 300, 0.25)])
        BudgetPlan(token_budget=900, quadratic_length=300, sample_cost=0.5)
        >>> agree(np.array([[900, 0, 500], [1000, 0, 250]]))
        BudgetPlan(token_budget=900, quadratic_length=None, sample_cost=0.5)
    """
    if isinstance(plans, np.ndarray):
        arr = plans.reshape(-1, 3).astype(np.int64)
    else:
        arr = np.array([p.encode() for p in plans], dtype=np.int64).reshape(-1, 3)
    if len(arr) == 0:
        raise ValueError("agree() got no plans: it needs every rank's plan (at least one). "
                         "Fix: pass the plans gathered from all ranks.")
    qs = arr[:, 1][arr[:, 1] > 0]
    return BudgetPlan(int(arr[:, 0].min()), int(qs.min()) if len(qs) else None, int(arr[:, 2].max()) / _MILLI)


class AutoBudget:
    """Planner settings from memory and time models of a training step, fitted online.

    Args:
        cap: the memory a step may use at its peak (bytes, or whatever ``observe`` is given).
        start_budget: the token budget before the memory model is fitted.
        packed: batches are packed rows (features sum over samples) rather than padded.
        margin: the share of the cap kept free.
        growth: the most a proposal's budget grows over the last one (> 1).
        min_budget: the least budget proposed.
        max_points: observations each model keeps.
        floor: the least relative margin of the memory model's upper bound over its prediction.

    Example:
        >>> ab = AutoBudget(cap=1e6, start_budget=1000)
        >>> ab.propose()
        BudgetPlan(token_budget=1000, quadratic_length=None, sample_cost=0.0)
        >>> for b, l in [(4, 100), (2, 300), (8, 50), (1, 600), (3, 200), (6, 120), (5, 70)]:
        ...     f = shape_features([l] * b)
        ...     ab.observe(f, peak=100.0 * f[0] + 0.5 * f[1] + 1000.0 * f[2] + 2e5)
        >>> ab.propose()   # fitted: budget (0.9 x 1e6 / 1.01 - 2e5) / 100, q = 100 / 0.5, 1000 / 100 a sample
        BudgetPlan(token_budget=6910, quadratic_length=200, sample_cost=10.0)
    """

    def __init__(self, cap: float, start_budget: int, *, packed: bool = False, margin: float = 0.1,
                 growth: float = 1.5, min_budget: int = 1, max_points: int = 512, floor: float = 0.01) -> None:
        if not (0 < float(cap) < math.inf):
            raise ValueError(f"cap={cap!r}: the memory cap must be a positive finite number (e.g. bytes). "
                             f"Fix: pass the accelerator's usable memory.")
        if int(min_budget) < 1 or int(start_budget) < int(min_budget):
            raise ValueError(f"start_budget={start_budget!r}, min_budget={min_budget!r}: budgets are ints with "
                             f"1 <= min_budget <= start_budget. Fix: pass e.g. start_budget=4096, min_budget=1.")
        if not (0 <= margin < 1) or not (growth > 1):
            raise ValueError(f"margin={margin!r}, growth={growth!r}: the margin must be in [0, 1) and the growth "
                             f"> 1. Fix: pass e.g. margin=0.1, growth=1.5.")
        self.cap = float(cap)
        self.packed = bool(packed)
        self.margin = float(margin)
        self.growth = float(growth)
        self.min_budget = int(min_budget)
        self.memory = StepModel("peak memory", max_points, floor=floor)
        self.time = StepModel("step seconds", max_points, floor=floor)
        self._cap_eff = self.cap
        self._budget = int(start_budget)
        self._last: Optional[BudgetPlan] = None
        self._window_rate: Optional[float] = None  # the most memory per token of a batch since the last proposal
        self._oom_pending = False
        self._ooms = 0

    @property
    def effective_cap(self) -> float:
        """The cap after out-of-memory steps lowered it."""
        return self._cap_eff

    @property
    def last_plan(self) -> Optional[BudgetPlan]:
        """The last proposal (None before the first)."""
        return self._last

    def _usable(self) -> float:
        return (1.0 - self.margin) * self._cap_eff

    def observe(self, features: Any, peak: Optional[float] = None, seconds: Optional[float] = None) -> None:
        """Feed one step: its batch's features (``shape_features``), its peak memory and/or its seconds.

        Example:
            >>> ab = AutoBudget(1e6, 100); ab.observe(shape_features([10, 10]), peak=5e4, seconds=0.1)
            >>> len(ab.memory), len(ab.time)
            (1, 1)
        """
        if peak is not None:
            self.memory.observe(features, peak)
            rate = float(peak) / max(float(np.asarray(features, dtype=np.float64)[0]), 1.0)
            self._window_rate = rate if self._window_rate is None else max(self._window_rate, rate)
        if seconds is not None:
            self.time.observe(features, seconds)

    def on_oom(self, features: Any) -> None:
        """An out-of-memory step of this batch: the effective cap drops to 0.9 x its predicted memory
        (once fitted), and the next proposal shrinks (at least to 0.9 x the last budget; half before
        the model is fitted).

        Example:
            >>> ab = AutoBudget(1e6, 1000); _ = ab.propose(); ab.on_oom(shape_features([100] * 10))
            >>> ab.propose().token_budget
            500
        """
        self._ooms += 1
        self._oom_pending = True
        pred = self.memory.predict(features)
        if pred is not None and pred > 0:
            self._cap_eff = min(self._cap_eff, 0.9 * pred)

    def _upper_coefficients(self) -> Optional[np.ndarray]:
        coef = self.memory.coefficients()
        if coef is None:
            return None
        return np.array(list(coef.values())) * self.memory.upper_factor

    def model_plan(self) -> Optional[BudgetPlan]:
        """The plan the fitted memory model allows under the usable cap (None before fitted): the exact
        mapping of its linear upper bound, the budget then lowered until the largest batch at each length
        the run has shown stays under the cap by the full upper bound (with the coefficients' uncertainty).

        Example:
            >>> print(AutoBudget(1e6, 100).model_plan())
            None
        """
        up = self._upper_coefficients()
        if up is None:
            return None
        a, b, c, d = (float(v) for v in up)
        room = self._usable() - d
        if room <= 0:
            return BudgetPlan(self.min_budget, 1, 0.0)
        a_eff = max(a, b, room / _MAX_BUDGET)  # >= a: conservative; >= b: q >= 1
        budget = int(min(math.floor(room / a_eff), _MAX_BUDGET))
        q = None if b <= 0 or a_eff / b > _MAX_BUDGET else max(1, int(math.floor(a_eff / b)))
        s = min(_ceil_milli(c / a_eff), float(_MAX_BUDGET))
        plan = BudgetPlan(max(self.min_budget, budget), q, s)
        if self._worst_batches_fit(plan):
            return plan
        lo, hi = self.min_budget, plan.token_budget  # the largest budget whose worst batches fit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._worst_batches_fit(dataclasses.replace(plan, token_budget=mid)):
                lo = mid
            else:
                hi = mid - 1
        return dataclasses.replace(plan, token_budget=lo)

    def _worst_batches_fit(self, plan: BudgetPlan) -> bool:
        """Whether, at each batch length the run has shown (33 quantiles of the observed batches'
        ``square_tokens / tokens``: their longest length padded, a token-weighted mean packed), the
        largest batch of that length the plan admits stays under the usable cap by the memory model's
        full upper bound (the lengths never seen rely on the linear bound alone)."""
        pts = self.memory.points()
        pts = pts[pts[:, 0] > 0]
        if not len(pts):
            return True
        seen = np.unique(np.quantile(pts[:, 1] / pts[:, 0], np.linspace(1 / 32, 1, 32)))
        counts = plan.cost_model().copies_that_fit_unrounded(np.ceil(seen)[:, None]).astype(np.float64)
        keep = counts >= 1
        lengths, counts = seen[keep], counts[keep]
        feats = np.stack([counts * lengths, counts * lengths * lengths, counts, np.ones_like(counts)], axis=1)
        return bool((self.memory.upper(feats) <= self._usable()).all()) if len(feats) else True

    def propose(self) -> BudgetPlan:
        """The planner's settings for the next window (fits the models first).

        Example:
            >>> ab = AutoBudget(1e6, 1000, growth=2.0); _ = ab.propose()
            >>> ab.observe(shape_features([100] * 10), peak=1e5); ab.propose().token_budget   # well under: grows
            2000
        """
        usable = self._usable()
        model = self.model_plan()
        if model is None:
            budget = self._budget
            if self._oom_pending:
                budget = budget // 2
            elif self._window_rate is not None and self._window_rate > 0:
                # memory per token only falls as batches grow (the constant spreads): the budget at which
                # the costliest batch per token seen would reach the usable cap is safe
                budget = math.floor(min(budget * self.growth, usable / self._window_rate))
            plan = BudgetPlan(max(self.min_budget, budget), None, 0.0)
        else:
            budget = model.token_budget
            if self._last is not None and self._oom_pending:
                budget = min(budget, math.floor(0.9 * self._last.token_budget))
            plan = BudgetPlan(max(self.min_budget, budget), model.quadratic_length, model.sample_cost)
        self._budget = plan.token_budget
        self._last = plan
        self._window_rate = None
        self._oom_pending = False
        return plan

    def longest_fitting_length(self) -> Optional[int]:
        """The longest sample whose batch of one stays under the usable cap by the memory model's linear
        upper bound, ``predict x upper_factor`` (None before fitted; 0 when none does).

        Example:
            >>> print(AutoBudget(1e6, 100).longest_fitting_length())
            None
        """
        up = self._upper_coefficients()
        if up is None:
            return None
        a, b, c, d = (float(v) for v in up)
        room = self._usable() - c - d
        if room < 0:
            return 0
        if a > 0 or b > 0:
            # the positive root of b x^2 + a x = room, in the form without cancellation: (-a + sqrt(...)) / 2b
            # gave 0 for a b of float noise (1e-17) next to a of 100 (the sample "could not fit" any cap)
            x = 2.0 * room / (a + math.sqrt(a * a + 4.0 * b * room))
        else:
            x = float(_MAX_BUDGET)
        length = int(min(math.floor(x), _MAX_BUDGET))
        while length > 0 and a * length + b * length * length + c + d > self._usable():
            length -= 1
        return length

    def max_length_fits(self, length: int) -> bool:
        """Whether one sample of this length fits the cap (True before the model is fitted).

        Example:
            >>> AutoBudget(1e6, 100).max_length_fits(10 ** 9)
            True
        """
        longest = self.longest_fitting_length()
        return longest is None or int(length) <= longest

    def check_max_length(self, length: int) -> None:
        """Raise ValueError when one sample of this length cannot fit under the cap.

        Example:
            >>> AutoBudget(1e6, 100).check_max_length(4096)
        """
        if self.max_length_fits(length):
            return
        need = self.memory.predict(shape_features([int(length)], self.packed)) * self.memory.upper_factor
        raise ValueError(
            f"a sample of length {int(length)} needs about {need:.4g} of memory by the fitted step model, over "
            f"{1 - self.margin:g} x the memory cap {self._cap_eff:.4g}: no batch can hold it (the longest that "
            f"fits is {self.longest_fitting_length()}). Fix: raise the memory cap, lower margin, or truncate "
            f"samples to at most that length.")

    def time_cost(self, lengths: Any) -> Optional[float]:
        """Predicted seconds of a step on a batch of these lengths (None before the time model is fitted).

        Example:
            >>> print(AutoBudget(1e6, 100).time_cost([10, 20]))
            None
        """
        return self.time.predict(shape_features(lengths, self.packed))

    def metrics(self) -> Dict[str, Any]:
        """The models' coefficients and errors, the effective cap and the last proposal (plain data).

        Example:
            >>> sorted(AutoBudget(1e6, 100).metrics())[:3]
            ['cap', 'effective_cap', 'last_plan']
        """
        last = None if self._last is None else dataclasses.asdict(self._last)
        return {
            "cap": self.cap,
            "effective_cap": self._cap_eff,
            "last_plan": last,
            "memory_coefficients": self.memory.coefficients(),
            "memory_relative_error": self.memory.relative_error(),
            "memory_upper_factor": self.memory.upper_factor,
            "ooms": self._ooms,
            "time_coefficients": self.time.coefficients(),
            "time_relative_error": self.time.relative_error(),
        }

    @staticmethod
    def agree(plans: Union[Sequence[BudgetPlan], np.ndarray]) -> BudgetPlan:
        """``odb.plan.auto_budget.agree``: the most conservative of every rank's plan.

        Example:
            >>> AutoBudget.agree([BudgetPlan(5), BudgetPlan(3)]).token_budget
            3
        """
        return agree(plans)

    def state_dict(self) -> Dict[str, Any]:
        """Plain data (JSON-able) from which ``load_state_dict`` reproduces the same proposals.

        Example:
            >>> AutoBudget(1e6, 100).state_dict()["budget"]
            100
        """
        return {
            "version": 1,
            "cap": self.cap,
            "effective_cap": self._cap_eff,
            "packed": self.packed,
            "margin": self.margin,
            "growth": self.growth,
            "min_budget": self.min_budget,
            "budget": self._budget,
            "last": None if self._last is None else dataclasses.asdict(self._last),
            "window_rate": self._window_rate,
            "oom_pending": self._oom_pending,
            "ooms": self._ooms,
            "memory": self.memory.state_dict(),
            "time": self.time.state_dict(),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output.

        Example:
            >>> a = AutoBudget(1e6, 100); _ = a.propose()
            >>> b = AutoBudget(1e6, 5); b.load_state_dict(a.state_dict()); b.propose() == a.propose()
            True
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        unknown = [k for k in state if k not in _STATE_KEYS]
        if missing or unknown or state.get("version") != 1:
            raise ValueError(
                f"auto budget state with missing keys {missing}, unknown keys {unknown}, version "
                f"{state.get('version')!r}: AutoBudget loads only what its state_dict() (version 1) saved. "
                f"Fix: pass the dict AutoBudget.state_dict() returned.")
        self.cap = float(state["cap"])
        self._cap_eff = float(state["effective_cap"])
        self.packed = bool(state["packed"])
        self.margin = float(state["margin"])
        self.growth = float(state["growth"])
        self.min_budget = int(state["min_budget"])
        self._budget = int(state["budget"])
        last = state["last"]
        self._last = None if last is None else BudgetPlan(int(last["token_budget"]), last["quadratic_length"],
                                                          float(last["sample_cost"]))
        self._window_rate = None if state["window_rate"] is None else float(state["window_rate"])
        self._oom_pending = bool(state["oom_pending"])
        self._ooms = int(state["ooms"])
        self.memory.load_state_dict(state["memory"])
        self.time.load_state_dict(state["time"])


def merge_states(states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One ``AutoBudget.state_dict()`` from several ranks' (an elastic resume, odb.resume.elastic), for
    every new rank to start from: the state of the most conservative rank, the one whose next proposal has
    the least token budget (the first such rank on a tie), as the ranks' agreement (``agree``) would have
    been bound by it; with what any rank learned of out-of-memory steps: the least effective cap, an OOM
    pending where any rank had one, the most OOMs a rank counted (each rank's next proposal is judged with
    them). Copies of one state merge into that state.

    Example:
        >>> a, b = AutoBudget(1e6, 100), AutoBudget(1e6, 80)
        >>> merge_states([a.state_dict(), b.state_dict()])["budget"]
        80
    """
    shared = {"effective_cap": min(float(s["effective_cap"]) for s in states),
              "oom_pending": any(bool(s["oom_pending"]) for s in states), "ooms": max(int(s["ooms"]) for s in states)}
    candidates = [dict(s, **shared) for s in states]

    def next_budget(state: Dict[str, Any]) -> int:
        budget = AutoBudget(float(state["cap"]), int(state["budget"]), min_budget=int(state["min_budget"]))
        budget.load_state_dict(state)
        return budget.propose().token_budget

    budgets = [next_budget(s) for s in candidates]
    return candidates[budgets.index(min(budgets))]
