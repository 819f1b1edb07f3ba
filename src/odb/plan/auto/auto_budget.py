"""``token_budget="auto"``: the planner's settings from a memory model fitted on the run (pure numpy).

``AutoBudget`` fits two ``StepModel``\\ s online, the peak memory of a step and its seconds,
each ``a * tokens + b * square_tokens + c * samples + d + e * supervised_tokens + f *
image_patches`` of the batch (``odb.plan.auto.step_model``). Each window it proposes the planner's
settings (``BudgetPlan``, ``odb.plan.auto.budget_plan``) so that every batch the planner accepts
stays, by the memory model's *upper* bound, under ``(1 - margin)`` x the memory cap. With C'
that share of the cap (less the constant d), a padded batch of B samples of longest length L,
with S supervised tokens and P image patches in all, fits when::

    B (a L + b L^2 + c) + e S + f P + d <= C'
        <=>   B (L + L^2 / q + c / a) + (e / a) S + (f / a) P <= (C' - d) / a,   q = a / b

which is exactly ``CostModel((token_budget,), quadratic_length=q, sample_cost=c / a,
loss_token_cost=e / a, image_patch_cost=f / a)`` with ``token_budget = floor((C' - d) / a)``,
``q = floor(a / b)`` (None when b is 0) and each cost rounded up to a thousandth: each rounding
errs on the safe side. Packed rows (the sum over their samples) map the same way. ``e`` is what a
supervised token costs beyond a token: about vocabulary x bytes with a chunked or fused loss
(logits for supervised tokens only), about 0 with a plain cross-entropy (whose logits for every
token are in ``a``). ``f`` is the vision tower's memory per image patch.

Before the memory model is fitted (a few steps of varied shapes) the proposal is the start
budget, grown by at most ``growth`` per proposal, and to no more than the budget at which the
costliest batch per token observed since the last proposal would reach the usable cap. Once
fitted, the proposal is the model's: the largest budget whose batches of the lengths the run
has shown stay under the usable cap by the full upper bound,
which adds the coefficients' uncertainty: a noiseless fit jumps to its budget at once, a
noisy one far from the shapes it measured extrapolates no further than its standard errors
allow. An out-of-memory step lowers the effective cap below that batch's prediction and
shrinks the next proposal to at most 0.9 x the last. Under several
ranks each sends its plan (``BudgetPlan.encode``, ``PLAN_FIELDS`` int64) in the per-window exchange and
all plan with ``agree``: the most conservative of them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, Optional, Sequence, Union

import numpy as np

from odb.plan.auto.budget_plan import MAX_BUDGET, PLAN_FIELDS, BudgetPlan, agree, plan_of_coefficients
from odb.plan.auto.step_model import StepModel, shape_features

__all__ = ["AutoBudget", "BudgetPlan", "PLAN_FIELDS", "agree", "merge_states"]

_STATE_KEYS = ("version", "cap", "effective_cap", "packed", "margin", "growth", "min_budget", "budget", "last",
               "window_rate", "oom_pending", "ooms", "memory", "time")


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
        >>> ab.propose().token_budget
        1000
        >>> for b, l, s in [(4, 100, 30), (2, 300, 290), (8, 50, 10), (1, 600, 100), (3, 200, 200), (6, 120, 60),
        ...                 (5, 70, 35)]:
        ...     f = shape_features([l] * b, supervised=[s] * b)
        ...     ab.observe(f, peak=100.0 * f[0] + 0.5 * f[1] + 1000.0 * f[2] + 2e5 + 300.0 * f[4])
        >>> p = ab.propose()   # fitted: budget (0.9 x 1e6 / 1.01 - 2e5) / 100, q ~ 100 / 0.5 (floored)
        >>> p.token_budget, p.quadratic_length in (199, 200), p.sample_cost, p.loss_token_cost  # 1000 / 100, 300 / 100
        (6910, True, 10.0, 3.0)
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
        """Feed one step: its batch's features (``shape_features``: its lengths, supervised tokens and image
        patches), its peak memory and/or its seconds.

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

    def side_ratios(self) -> np.ndarray:
        """(2,) the most supervised tokens and image patches per token of any batch the memory model keeps
        (what the worst batches at a length are assumed to hold; zeros before any point).

        Example:
            >>> ab = AutoBudget(1e6, 100); ab.observe(shape_features([10, 10], supervised=[5, 10]), peak=1.0)
            >>> ab.side_ratios().tolist()
            [0.75, 0.0]
        """
        pts = self.memory.points()
        pts = pts[pts[:, 0] > 0]
        if not len(pts):
            return np.zeros(2)
        return (pts[:, 4:6] / pts[:, :1]).max(axis=0)

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
        a, b, c, d, e, f = (float(v) for v in up)
        room = self._usable() - d
        plan = plan_of_coefficients(a, b, c, e, f, room, self.min_budget)
        if room <= 0 or self._worst_batches_fit(plan):
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
        full upper bound (the lengths never seen rely on the linear bound alone). Each sample of such a
        batch holds the most supervised tokens and patches per token seen (``side_ratios``)."""
        pts = self.memory.points()
        pts = pts[pts[:, 0] > 0]
        if not len(pts):
            return True
        seen = np.unique(np.quantile(pts[:, 1] / pts[:, 0], np.linspace(1 / 32, 1, 32)))
        side = np.outer(seen, self.side_ratios())  # per sample: supervised tokens, patches
        cost = plan.cost_model()
        counts = cost.copies_that_fit_unrounded(np.ceil(seen)[:, None], cost.side_cost(side[:, ::-1]))
        counts = counts.astype(np.float64)
        keep = counts >= 1
        lengths, counts, side = seen[keep], counts[keep], side[keep]
        feats = np.stack([counts * lengths, counts * lengths * lengths, counts, np.ones_like(counts),
                          counts * side[:, 0], counts * side[:, 1]], axis=1)
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
            plan = BudgetPlan(max(self.min_budget, budget))
        else:
            budget = model.token_budget
            if self._last is not None and self._oom_pending:
                budget = min(budget, math.floor(0.9 * self._last.token_budget))
            plan = dataclasses.replace(model, token_budget=max(self.min_budget, budget))
        self._budget = plan.token_budget
        self._last = plan
        self._window_rate = None
        self._oom_pending = False
        return plan

    def longest_fitting_length(self) -> Optional[int]:
        """The longest sample whose batch of one stays under the usable cap by the memory model's linear
        upper bound, ``predict x upper_factor`` (None before fitted; 0 when none does); the sample holds
        the most supervised tokens and patches per token seen (``side_ratios``).

        Example:
            >>> print(AutoBudget(1e6, 100).longest_fitting_length())
            None
        """
        up = self._upper_coefficients()
        if up is None:
            return None
        a, b, c, d, e, f = (float(v) for v in up)
        a += float(np.array([e, f]) @ self.side_ratios())  # a sample's side costs per token
        room = self._usable() - c - d
        if room < 0:
            return 0
        if a > 0 or b > 0:
            # the positive root of b x^2 + a x = room, in the form without cancellation: (-a + sqrt(...)) / 2b
            # gave 0 for a b of float noise (1e-17) next to a of 100 (the sample "could not fit" any cap)
            x = 2.0 * room / (a + math.sqrt(a * a + 4.0 * b * room))
        else:
            x = float(MAX_BUDGET)
        length = int(min(math.floor(x), MAX_BUDGET))
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
        side = self.side_ratios() * int(length)
        need = self.memory.predict(shape_features([int(length)], self.packed, side[0], side[1]))
        need *= self.memory.upper_factor
        raise ValueError(
            f"a sample of length {int(length)} needs about {need:.4g} of memory by the fitted step model, over "
            f"{1 - self.margin:g} x the memory cap {self._cap_eff:.4g}: no batch can hold it (the longest that "
            f"fits is {self.longest_fitting_length()}). Fix: raise the memory cap, lower margin, or truncate "
            f"samples to at most that length.")

    def time_cost(self, lengths: Any, supervised: Any = None, patches: Any = None) -> Optional[float]:
        """Predicted seconds of a step on a batch of these lengths, supervised tokens and image patches (per
        sample, or None) (None before the time model is fitted).

        Example:
            >>> print(AutoBudget(1e6, 100).time_cost([10, 20]))
            None
        """
        return self.time.predict(shape_features(lengths, self.packed, supervised, patches))

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
        """``odb.plan.auto.auto_budget.agree``: the most conservative of every rank's plan.

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
        self._last = None if last is None else BudgetPlan(
            int(last["token_budget"]), last["quadratic_length"], float(last["sample_cost"]),
            float(last.get("loss_token_cost", 0.0)), float(last.get("image_patch_cost", 0.0)))
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
