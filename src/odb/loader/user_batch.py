"""The user's batch, read where they wrote it: a DataLoader's ``batch_size`` becomes odb's optimizer step.

A training script steps its optimizer every ``A`` batches of ``B`` samples on each of ``W``
ranks. ``odb.apply(loader, ...)`` reads ``B`` from the loader, ``ODBDataLoader(..., batch_size=B)``
from its argument, ``A`` from ``gradient_accumulation_steps`` (1 by default): odb then keeps
those ``B x A x W`` samples in every optimizer step (``global_batch_size``) and only chooses the
micro-batches inside it under the token budget. Budget-filled steps (as many samples as the budget
holds, other updates than the user's) are there only when asked for by name:
``global_batch_size=None``.

Example:
    >>> import odb
    >>> step = UserBatch(4, "the DataLoader's batch_size", "odb.apply")
    >>> cfg = step.config(odb.ODBConfig(token_budget=64, gradient_accumulation_steps=2), {}, world_size=2)
    >>> cfg.global_batch_size, cfg.gradient_accumulation_steps
    (16, 1)
    >>> print(step.describe(cfg, 2))  # doctest: +NORMALIZE_WHITESPACE
    odb.apply keeps your batch: 4 samples per rank (the DataLoader's batch_size) x 2 accumulated x 2 ranks
    = 16 samples per optimizer step, cut into micro-batches under token_budget=64
"""

from __future__ import annotations

import logging
from typing import Any, Dict

from odb.config import ODBConfig

logger = logging.getLogger("odb")


class UserBatch:
    """The user's batch of ``size`` samples per rank, read from ``where`` (for messages), by ``who``."""

    def __init__(self, size: Any, where: str, who: str) -> None:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{who} got batch_size={size!r} ({where}). Rule: the samples of one batch per rank, an "
                             f"int >= 1: odb keeps batch_size x gradient_accumulation_steps x world size samples "
                             f"in each optimizer step. Fix: pass your batch size, e.g. batch_size=8.")
        self.size, self.where, self.who = size, where, who
        self.accumulation = 1

    def config(self, cfg: ODBConfig, given: Dict[str, Any], world_size: int) -> ODBConfig:
        """``cfg`` (built from the user's options, ``given`` being the keyword options as passed) with the
        user's optimizer step: ``global_batch_size = size x gradient_accumulation_steps x world_size``,
        unless ``global_batch_size`` was given (None: budget-filled steps, asked for by name)."""
        self.accumulation = cfg.gradient_accumulation_steps
        wanted = self.size * self.accumulation * world_size
        explicit = "global_batch_size" in given or cfg.global_batch_size is not None
        if not explicit:
            return cfg.replace(global_batch_size=wanted, gradient_accumulation_steps=1)
        g = cfg.global_batch_size
        if g is not None and self.size > 1 and g != wanted:
            raise ValueError(
                f"{self.who} got global_batch_size={g} and a batch of {self.size} samples per rank ({self.where}) "
                f"x {self.accumulation} accumulated x {world_size} ranks = {wanted}: two different optimizer steps. "
                f"Rule: one optimizer step, said once. Fix: drop global_batch_size (odb keeps your batch, "
                f"{wanted} samples per step), or set the batch to 1 and keep global_batch_size={g}.")
        return cfg

    def describe(self, cfg: ODBConfig, world_size: int) -> str:
        """One line that says which batch odb kept and where it read it."""
        if cfg.global_batch_size is None:
            return (f"{self.who}: budget-filled steps (global_batch_size=None): each optimizer step holds "
                    f"{cfg.gradient_accumulation_steps} micro-batch(es) filled to token_budget={cfg.token_budget}, "
                    f"not your batch of {self.size} ({self.where})")
        mine = self.size * self.accumulation * world_size
        if cfg.global_batch_size != mine:
            return (f"{self.who} keeps global_batch_size={cfg.global_batch_size} samples per optimizer step, cut "
                    f"into micro-batches under token_budget={cfg.token_budget}")
        return (f"{self.who} keeps your batch: {self.size} samples per rank ({self.where}) x {self.accumulation} "
                f"accumulated x {world_size} ranks = {mine} samples per optimizer step, cut into micro-batches "
                f"under token_budget={cfg.token_budget}")

    def keep(self, cfg: ODBConfig, given: Dict[str, Any], exchanges: Any) -> ODBConfig:
        """``config`` for the ranks of ``exchanges`` (an exchange factory; None: one process), and ``describe``
        logged at INFO on the ``odb`` logger."""
        world_size = exchanges.world()[1] if exchanges is not None else 1
        cfg = self.config(cfg, given, world_size)
        logger.info(self.describe(cfg, world_size))
        return cfg
