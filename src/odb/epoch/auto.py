"""token_budget="auto" of one loader's epochs: measurements in, planner settings out (see AutoControl).

The model and its proposals are odb.plan.auto.auto_budget's (pure); this module holds what runs on the
loader's two threads: the training thread feeds each handed-out batch's measurements, the batch
thread reads the plan of the next window, frozen at a step mark so that planning does not depend on
how far it has read ahead (a resumed run plans the same windows). AutoControl keeps two parts:
its settings (``AutoSettings``: the cap, the meter and how AutoBudgets are made and frozen) and
the epoch's frozen plans (``FrozenPlans``: the proposals frozen at step marks, the steps observed).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from odb.config import ODBConfig
from odb.epoch.budget import AutoWindows
from odb.plan.costs.plan_costs import PlanCosts


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    """What a loader's token_budget="auto" measures and models with: the memory ``cap`` (bytes), the
    ``meter`` (its peak since it was last read, or None), the ``packed`` layout, the safety ``margin``
    and ``time_balance`` (balance="time": each frozen proposal keeps a copy of the AutoBudget's time model).

    Example:
        >>> settings = AutoSettings(cap=10**9, meter=lambda: None, packed=False, margin=0.1)
        >>> plan, model = settings.freeze(settings.new_budget(64))
        >>> plan.token_budget, model
        (64, None)
    """

    cap: float
    meter: Callable[[], Optional[float]]
    packed: bool
    margin: float
    time_balance: bool = False

    def new_budget(self, start: int) -> Any:
        """A new AutoBudget (odb.plan.auto.auto_budget) whose first proposal is ``start`` tokens."""
        from odb.plan.auto.auto_budget import AutoBudget

        return AutoBudget(self.cap, int(start), packed=self.packed, margin=self.margin)

    def freeze(self, budget: Any) -> Tuple[Any, Any]:
        """``budget``'s proposal of now, with a copy of it for time balance (else None)."""
        return budget.propose(), (copy.deepcopy(budget) if self.time_balance else None)


class FrozenPlans:
    """One epoch's plans, each frozen once the training loop observed the steps before its mark: an entry
    is (BudgetPlan, AutoBudget copy for time balance, or None). Used behind AutoControl's lock; ``freeze``
    arguments make the entry of now, ``lookahead`` is the steps a framework holds fetched and not yet
    trained (a mark freezes once ``mark - lookahead`` steps are observed).

    Example:
        >>> plans = FrozenPlans(); plans.restart(("plan 0", None))
        >>> plans.mark(4, lookahead=0, freeze=lambda: ("plan 4", None)); plans.ready(4)
        False
        >>> plans.observe(4, lookahead=0, freeze=lambda: ("plan 4", None)); plans.use(4)
        ('plan 4', None)
    """

    def __init__(self) -> None:
        self.observed = 0  # steps of this epoch observed (ghosts counted)
        self.frozen: Dict[int, Tuple[Any, Any]] = {}  # mark -> (BudgetPlan, AutoBudget copy for time balance)
        self.marks: Set[int] = set()  # marks registered, not reached yet
        self.used: List[int] = []  # marks planned with, the latest last

    def restart(self, first: Tuple[Any, Any]) -> None:
        """A new epoch: nothing observed yet; its windows 1 and 2 plan under ``first`` (frozen at mark 0)."""
        self.observed, self.marks, self.used = 0, set(), []
        self.frozen = {0: first}

    def mark(self, mark: int, *, lookahead: int, freeze: Callable[[], Tuple[Any, Any]]) -> None:
        """Freeze the entry of ``mark`` once its steps are observed (now, if they are)."""
        if self.observed >= needed(mark, lookahead):
            if mark not in self.frozen:
                self.frozen[mark] = freeze()
        else:
            self.marks.add(mark)

    def observe(self, steps: int, *, lookahead: int, freeze: Callable[[], Tuple[Any, Any]]) -> None:
        """The training loop has observed ``steps`` steps of this epoch: freeze the marks they reach."""
        self.observed = max(self.observed, steps)
        for m in sorted(m for m in self.marks if needed(m, lookahead) <= self.observed):
            self.marks.discard(m)
            self.frozen.setdefault(m, freeze())

    def ready(self, mark: int) -> bool:
        """Whether the entry of ``mark`` is frozen."""
        return mark in self.frozen

    def use(self, mark: int) -> Optional[Tuple[Any, Any]]:
        """The entry frozen at ``mark`` (None: none), planned with now; a cursor may point at most one window
        back, so the entries before the previous mark planned with are dropped."""
        entry = self.frozen.get(mark)
        if not self.used or self.used[-1] != mark:
            self.used.append(mark)
        if len(self.used) > 2:
            keep = self.used[-2]
            self.used = self.used[-2:]
            self.frozen = {k: v for k, v in self.frozen.items() if k >= keep}
        return entry

    def model(self, mark: Optional[int]) -> Any:
        """The AutoBudget copy frozen at ``mark`` for time balance (None: none frozen there)."""
        entry = self.frozen.get(mark) if mark is not None else None
        return None if entry is None else entry[1]

    def state_dict(self) -> Dict[str, Any]:
        """Plain data: the observation count, the frozen entries (plans encoded), the marks pending and used."""
        frozen = [[int(k), [int(v) for v in plan.encode().tolist()], model.state_dict() if model is not None else None]
                  for k, (plan, model) in sorted(self.frozen.items())]
        return {"observed": self.observed, "frozen": frozen, "marks": sorted(self.marks), "used": list(self.used)}

    def load_state_dict(self, state: Dict[str, Any], *, model: Callable[[Any], Any],
                        freeze: Callable[[], Tuple[Any, Any]]) -> None:
        """Continue from ``state_dict``'s output (in a loader state's "budget"): ``model(state)`` makes a frozen
        AutoBudget copy; no entry (a re-partitioned epoch, ``merged_state``): its windows plan from now on."""
        from odb.plan.auto.auto_budget import BudgetPlan

        self.observed = int(state["observed"])
        self.marks = set(int(m) for m in state["marks"])
        self.used = [int(m) for m in state["used"]]
        self.frozen = {int(k): (BudgetPlan.decode(np.asarray(plan, dtype=np.int64)),
                                model(saved) if saved is not None else None)
                       for k, plan, saved in state["frozen"]}
        if not self.frozen:
            self.frozen = {0: freeze()}


def needed(mark: int, lookahead: int) -> int:
    """Steps observed before the proposal of ``mark`` freezes (``mark`` less the framework's lookahead)."""
    return max(0, mark - lookahead)


class AutoControl:
    """``token_budget="auto"`` of one loader: the AutoBudget (odb.plan.auto.auto_budget) fed by the training
    thread, read by the batch thread, behind one lock.

    Measuring (training thread): when the loop asks for the next batch, the batch handed out before
    (one micro-batch: with gradient accumulation each micro-batch is a point) is observed: the features
    of its samples' padded lengths (kept by ``planned`` when the batch was made), the seconds between
    handing it out and this request (the training step; the wait for data is not in it) and the meter's
    peak since it was handed out. Ghost batches are counted, not fed; a batch that ran out of memory
    (``on_oom``) feeds ``AutoBudget.on_oom`` instead.

    Applying (batch thread): the plan of an epoch's window w+1 is the AutoBudget's proposal frozen when
    the training loop had observed exactly the steps made before window w was planned (window 1 and 2:
    the proposal at the epoch's start). The plans are so a function of the observations, not of how
    far the batch thread runs ahead: a resumed run plans the same windows (the state holds the
    AutoBudget's, the frozen proposals and the observation count). The batch thread waits for that
    point (it is normally a window behind it).

    Its parts: ``settings`` (AutoSettings: made from the constructor's arguments) and ``plans`` (FrozenPlans:
    the epoch's frozen proposals and its steps observed).

    Example:
        >>> from odb.epoch.auto import AutoControl
        >>> auto = AutoControl(cap=10**9, meter=lambda: None, packed=False, margin=0.1)
        >>> auto.start(64); auto.begin_epoch(); auto.plan_at(0).token_budget
        64
    """

    def __init__(self, *, cap: float, meter: Callable[[], Optional[float]], packed: bool, margin: float,
                 time_balance: bool = False, options: Optional[ODBConfig] = None) -> None:
        self.settings = AutoSettings(cap=cap, meter=meter, packed=packed, margin=margin, time_balance=time_balance)
        self.options = options  # the user's (None: a control made by hand, e.g. in a test: the defaults)
        self.resumed_state = False  # a mid-epoch state gave this control its place in the epoch
        self.budget: Any = None  # odb.plan.auto.auto_budget.AutoBudget, made by start()
        self.start_budget: Optional[int] = None
        self.lock = threading.Condition()
        self.clock: Callable[[], float] = time.perf_counter
        self.features: Dict[int, np.ndarray] = {}  # step -> features of a batch made, not yet observed
        self.plans = FrozenPlans()  # this epoch's proposals frozen at step marks, its steps observed
        self.in_flight: Optional[List[Any]] = None  # [step, ghost, t0, oom] of the batch handed out last
        self.closed = False
        self.wait_limit_s = 1800.0  # plan_at's longest wait (the loader sets exchange_timeout_s)
        # An integration whose framework fetches batches ahead of training them (HF Trainer's gradient
        # accumulation, Lightning) measures each micro-batch itself (``begin``/``end``, see
        # ``measure_explicitly``): the loader's next() then says nothing about which batch ran, and a window's
        # plan waits only for the steps up to ``lookahead`` before its freeze point.
        self.explicit = False
        self.lookahead = 0

    # ---- set-up --------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self.budget is not None

    def start(self, start_budget: int) -> None:
        """Make the AutoBudget with the first windows' budget."""
        with self.lock:
            self.start_budget = int(start_budget)
            self.budget = self.settings.new_budget(self.start_budget)

    def begin_epoch(self) -> None:
        """A new epoch (not a resumed one): its windows 1 and 2 plan under the proposal of now."""
        with self.lock:
            self.features.clear()
            self.in_flight, self.closed = None, False
            self.plans.restart(self._freeze())

    def close(self) -> None:
        """The epoch stops: a batch thread waiting in ``plan_at`` goes on."""
        with self.lock:
            self.closed = True
            self.lock.notify_all()

    def reopen(self) -> None:
        """A resumed epoch starts: ``plan_at`` waits for the measurements again."""
        with self.lock:
            self.closed = False

    def _freeze(self) -> Tuple[Any, Any]:
        return self.settings.freeze(self.budget)

    # ---- the loader's budget (odb.epoch.budget.LoaderBudget) ------------------------
    def epoch(self) -> AutoWindows:
        """The next epoch's window budget."""
        opts = self.options
        start = self.start_budget or (opts.auto_start_budget if opts is not None else None) or PROVISIONAL_BUDGET
        costs = PlanCosts((int(start),)) if opts is None else PlanCosts.of(opts).with_budget(int(start))
        return AutoWindows(self, costs)

    def epoch_starts(self, peek: Callable[[int], Any], resumed: bool) -> None:
        """An epoch starts: the first epoch sets the start budget (``auto_start_budget``, else twice the
        longest of the first window's samples, read by ``peek(n)``); a new epoch plans its first windows
        under the proposal of now, a resumed one where its state left it."""
        if not self.started:
            opts = self.options if self.options is not None else ODBConfig(token_budget=1)
            self.start(opts.auto_start_budget or start_budget(peek, opts.first_window_size))
        if resumed and self.resumed_state:
            self.reopen()  # (the loader's stop() closed it)
        else:
            self.begin_epoch()
        self.resumed_state = False

    def set_token_budget(self, token_budget: Any) -> None:
        raise ValueError(f"set_token_budget({token_budget!r}) on a loader with token_budget='auto': the loader "
                         f"sets its budget from measured steps. Fix: build the loader with an int token_budget "
                         f"to set it yourself, or leave the auto budget alone.")

    def read_ahead_tokens(self) -> Optional[int]:
        """The budget moves: the read-ahead is bounded by ``buffer_size`` samples only."""
        return None

    def planning_config(self, window: Optional[AutoWindows], lengths: Any) -> ODBConfig:
        """The options ``len()``'s estimate plans with: the current window's budget, else the start rule's."""
        plan = window.plan if window is not None else None
        budget = plan.token_budget if plan is not None else self.start_budget or self.options.auto_start_budget
        if not budget:
            arr = np.asarray(lengths)
            budget = max(1, 2 * int(arr.reshape(len(arr), -1).sum(axis=1).max(initial=0)))
        return self.options.replace(token_budget=int(budget), balance="tokens")

    def stats(self, window: Optional[AutoWindows]) -> Dict[str, Any]:
        """``auto_*`` counters for ``odb_stats``, with the last planned window's budget."""
        out = self.metrics()
        plan = window.plan if window is not None else None
        out["auto_window_budget"] = None if plan is None else plan.token_budget
        return out

    def loader_state(self) -> Dict[str, Any]:
        """The loader's "budget" state: the AutoBudget's, the observations, the frozen proposals."""
        return self.state_dict()

    def load_loader_state(self, state: Optional[Dict[str, Any]], resumed: bool) -> None:
        """Continue from ``loader_state``'s output (``resumed``: mid-epoch)."""
        if state is not None:
            self.load_state_dict(state, resumed=resumed)
            self.resumed_state = resumed

    # ---- batch thread --------------------------------------------------------------
    def planned(self, step: int, lengths: np.ndarray, supervised: Any = None, patches: Any = None) -> None:
        """Step ``step`` was made from samples of (n, D) padded ``lengths``, with these supervised tokens and
        image patches per sample (not for ghosts)."""
        from odb.plan.auto.step_model import shape_features

        lengths = np.asarray(lengths)
        features = shape_features(lengths.sum(axis=1) if lengths.ndim == 2 else lengths, self.settings.packed,
                                  supervised, patches)
        with self.lock:
            self.features[int(step)] = features

    def mark(self, mark: int) -> None:
        """Freeze the proposal once ``mark`` steps of this epoch are observed (now, if they are)."""
        with self.lock:
            self.plans.mark(mark, lookahead=self.lookahead, freeze=self._freeze)

    def plan_at(self, mark: int) -> Any:
        """The proposal frozen at ``mark`` (waits for the training loop to get there)."""
        with self.lock:
            deadline = time.monotonic() + self.wait_limit_s
            while not self.plans.ready(mark) and not self.closed:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"odb token_budget='auto': the batch thread waited {self.wait_limit_s:g}s for the training "
                        f"loop to finish step {mark - 1} of this epoch (measured {self.plans.observed} steps) to plan "
                        f"the next window. Rule: the loop asks for each next batch after its step. Fix: keep "
                        f"iterating the loader, or pass an int token_budget.")
                self.lock.wait(0.1)
            entry = self.plans.use(mark)
            if entry is None:  # closed: the epoch stops, this plan is not used (the AutoBudget is left as it is)
                return self.budget.last_plan or self.settings.new_budget(self.start_budget).propose()
            return entry[0]

    def time_cost(self, mark: Optional[int], lengths: np.ndarray, side: Optional[np.ndarray] = None
                  ) -> Optional[float]:
        """Predicted seconds of a batch of ``lengths`` (and side counts: (n, 2) image patches, supervised
        tokens) under the model frozen at ``mark`` (None: unfitted)."""
        with self.lock:
            model = self.plans.model(mark)
            if model is None:
                return None
            lengths = np.asarray(lengths)
            patches, supervised = (None, None) if side is None else (np.asarray(side)[:, 0], np.asarray(side)[:, 1])
            return model.time_cost(lengths.sum(axis=1) if lengths.ndim == 2 else lengths, supervised, patches)

    # ---- training thread -----------------------------------------------------------
    def measure_explicitly(self, lookahead: int) -> None:
        """An integration calls ``begin``/``end`` around each micro-batch it trains, for a framework that holds
        up to ``lookahead`` batches fetched and not yet trained; the loader's own next()-time measuring stops.

        Example:
            >>> auto = AutoControl(cap=1e9, meter=lambda: None, packed=False, margin=0.1)
            >>> auto.measure_explicitly(3); auto.request(); auto.explicit, auto.lookahead
            (True, 3)
        """
        with self.lock:
            self.explicit, self.lookahead = True, max(0, int(lookahead))

    def request(self) -> None:
        """The loop asks for the next batch: the batch handed out before ran its step; observe it (not when
        an integration measures explicitly)."""
        if not self.explicit:
            self.end()

    def handed_out(self, step: int, ghost: bool) -> None:
        """The loop receives step ``step``: its measurement starts (not when an integration measures explicitly)."""
        if not self.explicit:
            self.begin(step, ghost)

    def end(self) -> None:
        """The micro-batch begun last has run its step: observe it (its features, the meter's peak, its seconds)."""
        with self.lock:
            flight, self.in_flight = self.in_flight, None
            if flight is None:
                return
            step, ghost, t0, oom = flight
            peak = self.settings.meter()
            seconds = self.clock() - t0
            features = self.features.pop(step, None)
            if not ghost and not oom and features is not None and self.budget is not None:
                self.budget.observe(features, peak=None if peak is None else float(peak), seconds=seconds)
            self.plans.observe(step + 1, lookahead=self.lookahead, freeze=self._freeze)
            self.lock.notify_all()

    def begin(self, step: int, ghost: bool) -> None:
        """Step ``step`` starts training: its measurement starts (the meter's peak so far is dropped)."""
        with self.lock:
            self.settings.meter()
            self.in_flight = [int(step), bool(ghost), self.clock(), False]

    def on_oom(self) -> None:
        """The batch handed out last ran out of memory (odb.train.oom): the AutoBudget learns it."""
        with self.lock:
            flight = self.in_flight
            if flight is None or flight[1] or self.budget is None:
                return
            features = self.features.get(flight[0])
            if features is not None and not flight[3]:
                self.budget.on_oom(features)
            flight[3] = True

    # ---- state and metrics ---------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Plain data: the AutoBudget's state, the observation count, the frozen proposals and marks (the
        step in flight is observed now: a state is taken between steps)."""
        self.end()
        with self.lock:
            return {"start": self.start_budget, "budget": None if self.budget is None else self.budget.state_dict(),
                    **self.plans.state_dict()}

    def load_state_dict(self, state: Dict[str, Any], resumed: bool) -> None:
        """Continue from ``state_dict``'s output (``resumed``: mid-epoch, else at an epoch's start)."""
        with self.lock:
            if state.get("start") is None:
                return
            self.start_budget = int(state["start"])
            self.budget = self.settings.new_budget(self.start_budget)
            self.budget.load_state_dict(state["budget"])
            self.features.clear()
            self.in_flight, self.closed = None, False
            if resumed:
                self.plans.load_state_dict(state, model=self._saved_model, freeze=self._freeze)

    def _saved_model(self, saved: Dict[str, Any]) -> Any:
        """An AutoBudget from its ``state_dict`` (a frozen copy for time balance)."""
        model = self.settings.new_budget(self.start_budget)
        model.load_state_dict(saved)
        return model

    def metrics(self) -> Dict[str, Any]:
        """``auto_*`` counters of the AutoBudget (empty before it starts)."""
        with self.lock:
            if self.budget is None:
                return {}
            out: Dict[str, Any] = {}
            for key, value in self.budget.metrics().items():
                if key == "last_plan":
                    value = value or {}
                    key, value = "", {"token_budget": value.get("token_budget"),
                                      "quadratic_length": value.get("quadratic_length"),
                                      "sample_cost": value.get("sample_cost"),
                                      "loss_token_cost": value.get("loss_token_cost"),
                                      "image_patch_cost": value.get("image_patch_cost")}
                if isinstance(value, dict):  # coefficients: one scalar each
                    out.update({f"auto_{key + '_' if key else ''}{k}": v for k, v in value.items()})
                else:
                    out[f"auto_{key}"] = value
            out["auto_observed_steps"] = self.plans.observed
            return out

    def check_length(self, length: int) -> None:
        """Refuse a sample that no batch can hold under the cap, by the fitted memory model."""
        with self.lock:
            if self.budget is not None:
                self.budget.check_max_length(int(length))

    def fits_alone(self, length: int) -> bool:
        """Whether a batch of this one sample fits the cap by the fitted memory model (True before the fit)."""
        with self.lock:
            return self.budget is None or self.budget.max_length_fits(int(length))

    def time_fitted(self, mark: Optional[int]) -> bool:
        """Whether the time model frozen at ``mark`` predicts (balance="time")."""
        with self.lock:
            model = self.plans.model(mark)
            return model is not None and model.time.coefficients() is not None


PROVISIONAL_BUDGET = 2**40  # without auto_start_budget: the budget until the first window is read


def start_budget(peek: Callable[[int], Any], first_window_size: int) -> int:
    """token_budget="auto" without auto_start_budget: twice the longest of the first window's samples
    (``peek(n)``: their metas, lengths first).

    Example:
        >>> start_budget(lambda n: [((3,),), ((9,),)], 8)
        18
    """
    metas = peek(first_window_size)
    longest = max((sum(meta[0]) if isinstance(meta[0], (tuple, list)) else int(meta[0]) for meta in metas),
                  default=1)
    return max(1, 2 * int(longest))


def merged_state(states: List[Optional[Dict[str, Any]]], step: int) -> Optional[Dict[str, Any]]:
    """The loader state's "budget" entry that every new rank of an elastic resume loads (odb.resume.elastic),
    from every old rank's (None where a rank had none): the AutoBudgets merged
    (odb.plan.auto.auto_budget.merge_states: the most conservative rank's, with every rank's OOMs),
    the least start budget, ``step`` steps of the epoch observed, and no frozen proposal: the re-partitioned
    epoch plans its remaining windows from the merged model (its first window under the merged state's
    proposal, the same on every new rank), and the ranks agree again through their exchange."""
    from odb.plan.auto.auto_budget import merge_states

    started = [s for s in states if s is not None and s.get("start") is not None]
    if not started:  # no rank had started: nothing learned yet
        return next((dict(s) for s in states if s is not None), None)
    return {"start": min(int(s["start"]) for s in started), "budget": merge_states([s["budget"] for s in started]),
            "observed": int(step), "frozen": [], "marks": [], "used": []}
