"""The planner's prices for one window, as one frozen value (pure).

``PlanCosts`` is what a window budget (odb.epoch.budget) hands the window planner before each window:
the token budget (one per length dimension, or one total), the quadratic length and the costs each
sample adds (per sample, per supervised token, per image patch). The user's options (``ODBConfig``) give the first value; ``token_budget="auto"`` and budget
schedules give the later ones, and nothing else changes between windows.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional, Tuple

if TYPE_CHECKING:
    from odb.config import ODBConfig


@dataclasses.dataclass(frozen=True)
class PlanCosts:
    """``token_budgets`` (a tuple: one total, or one per length dimension), ``quadratic_length`` (None:
    no quadratic term), and in tokens-equivalent: ``sample_cost`` per sample, ``loss_token_cost`` per
    supervised token, ``image_patch_cost`` per image patch.

    Example:
        >>> from odb.config import ODBConfig
        >>> PlanCosts.of(ODBConfig(token_budget=64, sample_cost=2.0))
        PlanCosts(token_budgets=(64,), quadratic_length=None, sample_cost=2.0, loss_token_cost=0.0, image_patch_cost=0.0)
        >>> PlanCosts.of(ODBConfig(token_budget=64)).with_budget((32, 8)).token_budget
        (32, 8)
    """

    token_budgets: Tuple[int, ...]
    quadratic_length: Optional[int] = None
    sample_cost: float = 0.0
    loss_token_cost: float = 0.0
    image_patch_cost: float = 0.0

    @staticmethod
    def of(cfg: "ODBConfig") -> "PlanCosts":
        """The costs the user's options set (``token_budget="auto"``: its start budget, see ODBConfig.token_budgets),
        the budget as one replica's (``context_parallel`` x the per-GPU ``token_budget``)."""
        budgets = cfg.replica_budget(tuple(int(v) for v in cfg.token_budgets))
        return PlanCosts(tuple(budgets), cfg.quadratic_length, float(cfg.sample_cost),
                         float(cfg.loss_token_cost), float(cfg.image_patch_cost))

    @property
    def token_budget(self) -> "int | Tuple[int, ...]":
        """The budget as a user writes it: an int, or the tuple of per-dimension budgets."""
        return self.token_budgets[0] if len(self.token_budgets) == 1 else self.token_budgets

    @property
    def total(self) -> int:
        """The sum of the budgets (what a window's tokens are counted against)."""
        return int(sum(self.token_budgets))

    def with_budget(self, token_budget: "int | Tuple[int, ...]") -> "PlanCosts":
        """The same costs under another token budget (an int or a per-dimension tuple)."""
        budgets = tuple(int(v) for v in token_budget) if isinstance(token_budget, tuple) else (int(token_budget),)
        return dataclasses.replace(self, token_budgets=budgets)
