"""How ranks pair their micro-batches in a step (``balance``): one class per criterion, pure.

Every rank ranks its groups by a *pairing cost* and step k pairs the k-th costliest group of
each rank, so the slowest rank of a step waits little. A criterion prices a group from its
padded lengths; it may not know how yet (a model still warming up): ``ready()`` says whether
it prices this window's groups, and the ranks pair by a criterion only in a window where it
is ready on every rank (the rank aligner exchanges the flag in the window's header), else by
the planner's cost, so no step pairs one rank's seconds with another's tokens.

A new criterion is one class here and one name in ``PAIRINGS`` (``register_pairing``), which
``ODBConfig.balance`` accepts.

Example:
    >>> import numpy as np
    >>> pairing = make_pairing("tokens", None)
    >>> pairing.ready(), pairing.price(np.array([[8], [6]]))
    (True, None)
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Protocol

import numpy as np


class Pairing(Protocol):
    """One balance criterion: what a rank tells the others and how it prices a group (``prices``: False
    where it never does, so the planner's cost pairs without any group's lengths being padded for it)."""

    prices: bool

    def freeze(self, step: int) -> None:
        """The steps made before the window about to be planned (a model frozen there prices it)."""

    def ready(self) -> bool:
        """Whether this rank prices this window's groups (exchanged: the ranks pair by it only when all are)."""

    def price(self, padded: np.ndarray, side: Optional[np.ndarray] = None) -> Optional[int]:
        """The pairing cost of a group of these padded lengths ((n, D) ints) and side counts ((n, 2): image
        patches, supervised tokens; odb.plan.costs.cost.split_side), or None: the planner's cost."""


class TokenPairing:
    """``balance="tokens"`` (default): the planner's cost (padded tokens) pairs the groups."""

    prices = False

    def freeze(self, step: int) -> None:
        return None

    def ready(self) -> bool:
        return True

    def price(self, padded: np.ndarray, side: Optional[np.ndarray] = None) -> Optional[int]:
        return None


class TimePairing:
    """``balance="time"``: predicted step seconds (in microseconds) pair the groups, once the step-time
    model frozen for the window predicts. ``model`` has ``time_fitted(step)`` and ``time_cost(step,
    padded, side)`` (``odb.epoch.auto.AutoControl``: token_budget="auto" fits it, with the batch's
    supervised tokens and image patches among its features, so vision cost counts)."""

    prices = True

    def __init__(self, model: Any) -> None:
        if model is None:
            raise ValueError("balance='time' needs a step-time model: token_budget='auto' fits it. Fix: pass "
                             "token_budget='auto', or balance='tokens'.")
        self.model = model
        self.frozen_at = 0

    def freeze(self, step: int) -> None:
        self.frozen_at = int(step)

    def ready(self) -> bool:
        return bool(self.model.time_fitted(self.frozen_at))

    def price(self, padded: np.ndarray, side: Optional[np.ndarray] = None) -> Optional[int]:
        seconds = self.model.time_cost(self.frozen_at, padded, side)
        return None if seconds is None else int(round(seconds * 1e6))


# name -> factory(step-time model or None): the values of ODBConfig.balance
PAIRINGS: Dict[str, Callable[[Any], Pairing]] = {"tokens": lambda model: TokenPairing(),
                                                 "time": TimePairing}


def register_pairing(name: str, factory: Callable[[Any], Pairing]) -> None:
    """Make ``balance=name`` pair by ``factory(model)`` (``model``: the step-time model with
    token_budget="auto", else None)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_pairing got name={name!r}: must be a non-empty str. Fix: pass e.g. 'samples'.")
    PAIRINGS[name] = factory


def make_pairing(balance: str, model: Any) -> Pairing:
    """The criterion ``balance`` names (``model``: the step-time model, or None)."""
    if balance not in PAIRINGS:
        raise ValueError(f"balance={balance!r} names no pairing criterion ({sorted(PAIRINGS)}). Fix: use one of "
                         f"them, or odb.plan.ranks.pairing.register_pairing({balance!r}, factory) first.")
    return PAIRINGS[balance](model)
