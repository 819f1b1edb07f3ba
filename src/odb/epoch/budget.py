"""The window budget: what prices the next window, in one seam.

An epoch run asks its window budget, before each window, for the planner's prices
(``PlanCosts``: odb.plan.costs.plan_costs), and tells it about the steps it makes. Three
implementations, chosen once from the user's options (odb.loader.budgets.make_budget):

- ``FixedBudget``: the ``token_budget`` the user set (or set later with ``set_token_budget``);
- the same with ``budget_schedule``: the budget of each optimizer step from the schedule;
- ``AutoWindows``: ``token_budget="auto"``, the memory model's plan of each window
  (odb.epoch.auto.AutoControl learns it across epochs; ``AutoWindows`` is one epoch's part).

The loader keeps one budget for its life (``LoaderBudget``: a ``FixedBudget``, or the
``AutoControl``) and gives each epoch run ``budget.epoch()``, its ``WindowBudget``. Neither the loader
nor the run branches on which kind it holds, and the user's ``ODBConfig`` is never replaced.

Example:
    >>> from odb.config import ODBConfig
    >>> fixed = FixedBudget(ODBConfig(token_budget=64, budget_schedule=((0, 32), (2, 64))))
    >>> window = fixed.epoch()
    >>> [window.next_window(step=0, window_index=0, planned=p).token_budget for p in (0, 2)]
    [32, 64]
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Sequence

import numpy as np

from odb.config import ODBConfig
from odb.plan.costs.plan_costs import PlanCosts
from odb.plan.costs.schedule import budget_at


class WindowBudget(Protocol):
    """One epoch's window budget (what an ``EpochRun`` asks)."""

    costs: PlanCosts  # the prices of the last window asked for

    time_model: Any  # what balance="time" prices with (odb.plan.ranks.pairing; None: no step-time model)

    def next_window(self, *, step: int, window_index: int, planned: int, alone: bool = False) -> PlanCosts:
        """The prices of the next window: ``step`` steps made so far, ``window_index`` windows planned,
        ``planned`` micro-batches planned (made or pending); ``alone``: this rank plans without the others."""

    def proposal(self) -> Optional[np.ndarray]:
        """This rank's encoded plan for the ranks to agree on with the window's header (None: nothing)."""

    def agreed(self, plan: Any) -> None:
        """Every rank's agreement on the proposals of the last header (odb.epoch.ranks.RankAligner.agreed_plan)."""

    def freeze_point(self, step: int) -> int:
        """The step whose measurements the window's models hold (what ``balance`` pairings freeze at)."""

    def made(self, step: int, lengths: np.ndarray, metas: Sequence[Any], cost: Any) -> None:
        """Step ``step`` was made of samples of these (n, D) lengths and metas (lengths, supervised tokens,
        image patches), planned under ``cost`` (not ghosts). Called for every batch: a budget that does not
        measure does nothing here."""

    def check_length(self, length: int) -> None:
        """Refuse a sample that no batch can hold (the memory model's cap); fixed budgets refuse nothing here."""

    def oversize(self, policy: str, length: int) -> str:
        """The ``oversize`` policy that applies to a sample over the window's budget."""

    def learns(self) -> bool:
        """Whether the budget moves with measurements (its batches' fill says nothing of the data)."""

    def state_dict(self) -> Optional[Dict[str, Any]]:
        """The part of an epoch's state this budget owns (None: nothing)."""

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        """Continue from ``state_dict``'s output."""


class FixedBudget:
    """``token_budget`` as the user set it, with its ``budget_schedule``: the loader's budget and, the same
    object, every epoch's (it holds no per-epoch state).

    With a schedule, a window plans under the budget of the optimizer step it starts
    (``global_batch_size``: one window per step; else the planned micro-batches over the
    accumulation). ``set_token_budget`` ends the schedule.
    """

    time_model = None

    def __init__(self, cfg: ODBConfig) -> None:
        self.options = cfg  # the user's options: set_token_budget is the user's change of them
        self.schedule = cfg.budget_schedule
        self.costs = PlanCosts.of(cfg)

    # ---- the loader's budget (LoaderBudget) -----------------------------------------------------
    def epoch(self) -> "FixedBudget":
        return self

    def set_token_budget(self, token_budget: Any) -> None:
        """From the next window on (validated as ``ODBConfig`` validates ``token_budget``)."""
        self.options = self.options.replace(token_budget=token_budget, budget_schedule=None)
        self.schedule = None
        self.costs = self.costs.with_budget(self.options.replica_budget(self.options.token_budget))

    def epoch_starts(self, peek: Any, resumed: bool) -> None:
        """An epoch starts (``peek(n)``: its first samples' metas; ``resumed``: a saved epoch goes on)."""

    def close(self) -> None:
        """The epoch stops."""

    def on_oom(self) -> None:
        """A batch ran out of memory (odb.train.oom): a fixed budget learns nothing."""

    def handed_out(self, step: int, ghost: bool) -> None:
        """The training loop received step ``step``: a fixed budget measures nothing."""

    def request(self) -> None:
        """The training loop asks for the next batch."""

    def read_ahead_tokens(self) -> Optional[int]:
        """Real tokens the read-ahead holds at most (a window's)."""
        return self.options.window_tokens

    def planning_config(self, window: Any, lengths: Any) -> ODBConfig:
        """The options the plan's estimates (``len()``) use: the user's."""
        return self.options

    def stats(self, window: Any) -> Dict[str, Any]:
        """The budget's counters for ``odb_stats`` (``window``: the current epoch's WindowBudget, or None)."""
        return {}

    def loader_state(self) -> Optional[Dict[str, Any]]:
        return None

    def load_loader_state(self, state: Optional[Dict[str, Any]], resumed: bool) -> None:
        """A fixed budget saves nothing beyond the user's options."""

    # ---- one epoch's window budget (WindowBudget) -----------------------------------------------
    def next_window(self, *, step: int, window_index: int, planned: int, alone: bool = False) -> PlanCosts:
        if self.schedule is not None:
            k = window_index if self.options.global_batch_size is not None else \
                planned // self.options.gradient_accumulation_steps
            self.costs = self.costs.with_budget(self.options.replica_budget(budget_at(self.schedule, k)))
        return self.costs

    def proposal(self) -> Optional[np.ndarray]:
        return None

    def agreed(self, plan: Any) -> None:
        pass

    def freeze_point(self, step: int) -> int:
        return step

    def made(self, step: int, lengths: np.ndarray, metas: Sequence[Any], cost: Any) -> None:
        pass

    def check_length(self, length: int) -> None:
        pass

    def oversize(self, policy: str, length: int) -> str:
        return policy

    def learns(self) -> bool:
        return False

    def state_dict(self) -> Optional[Dict[str, Any]]:
        return None

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        pass


class AutoWindows:
    """One epoch's part of ``token_budget="auto"``: each window's plan from the loader's AutoControl.

    Window w+1 plans under the AutoBudget's proposal frozen when the training loop had observed the
    steps made before window w was planned (odb.epoch.auto.AutoControl.plan_at); under several ranks it
    plans under the plan they agreed on at the last header, and sends this window's proposal with the
    next one. Its state (the freeze point, the agreed and the applied plan) is the epoch's "budget" part.
    """

    def __init__(self, control: Any, costs: PlanCosts) -> None:
        self.control = control
        self.costs = costs
        self.mark: Optional[int] = None  # steps made before the last planned window (its freeze point)
        self.agreed_plan: Any = None  # the plan the ranks agreed on at the last header, for the next window
        self.plan: Any = None  # the plan of the last planned window (BudgetPlan)
        self._proposal: Any = None
        self._frozen_at = 0

    @property
    def time_model(self) -> Any:
        """What ``balance="time"`` prices with (odb.plan.ranks.pairing.TimePairing)."""
        return self.control

    def _apply(self, plan: Any) -> None:
        self.plan = plan
        self.costs = PlanCosts((int(plan.token_budget),), plan.quadratic_length, float(plan.sample_cost),
                               float(plan.loss_token_cost), float(plan.image_patch_cost))

    def next_window(self, *, step: int, window_index: int, planned: int, alone: bool = False) -> PlanCosts:
        self._frozen_at = 0 if self.mark is None else self.mark
        proposal = self.control.plan_at(self._frozen_at)
        self.mark = step  # the steps made before this window: the next window's freeze point
        self.control.mark(self.mark)
        self._proposal = proposal
        # alone: this rank's own proposal; else the plan the ranks agreed on at the last header (it sends its
        # proposal with this window's)
        self._apply(proposal if alone or self.agreed_plan is None else self.agreed_plan)
        return self.costs

    def proposal(self) -> Optional[np.ndarray]:
        return None if self._proposal is None else self._proposal.encode()

    def agreed(self, plan: Any) -> None:
        if plan is not None:
            self.agreed_plan = plan

    def freeze_point(self, step: int) -> int:
        return self._frozen_at

    def made(self, step: int, lengths: np.ndarray, metas: Sequence[Any], cost: Any) -> None:
        self.control.planned(step, cost.pad(lengths), [m[1] for m in metas], [m[2] for m in metas])

    def check_length(self, length: int) -> None:
        self.control.check_length(int(length))

    def oversize(self, policy: str, length: int) -> str:
        # The window's budget is the model's (or the start's), not a rule of the user's. A sample over it that
        # fits the cap alone by the memory model (any sample before the model is fitted: its step measures it)
        # trains alone; one that cannot fit was refused by check_length (or is skipped).
        return "skip" if policy == "skip" and not self.control.fits_alone(int(length)) else "alone"

    def learns(self) -> bool:
        return True

    def state_dict(self) -> Optional[Dict[str, Any]]:
        return {"mark": self.mark,
                "agreed": None if self.agreed_plan is None else [int(v) for v in self.agreed_plan.encode()],
                "plan": None if self.plan is None else [int(v) for v in self.plan.encode()]}

    def load_state_dict(self, state: Optional[Dict[str, Any]]) -> None:
        if state is None:
            return
        from odb.plan.auto.auto_budget import BudgetPlan

        self.mark = None if state["mark"] is None else int(state["mark"])
        self.agreed_plan = None if state["agreed"] is None else BudgetPlan.decode(state["agreed"])
        if state["plan"] is not None:
            self._apply(BudgetPlan.decode(state["plan"]))
