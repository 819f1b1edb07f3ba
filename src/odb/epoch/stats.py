"""Counters of one epoch of odb batching on one rank."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict


@dataclasses.dataclass
class EpochStats:
    """Counters of one epoch on this rank."""

    steps: int = 0
    ghost_steps: int = 0
    samples: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    loss_tokens: int = 0
    windows: int = 0
    oversize_alone: int = 0
    oversize_skipped: int = 0
    dropped_samples: int = 0
    moved_samples: int = 0  # samples this rank sent to others (a step planned across ranks, online lengths)
    moved_bytes: int = 0  # their pickled bytes
    move_s: float = 0.0  # seconds this rank spent moving them (pickle, exchange, unpickle)
    price_dealt_steps: int = 0  # steps planned across ranks whose micro-batches balance="time" dealt by seconds
    split_groups: int = 0
    carry_groups: int = 0
    deferred_groups: int = 0
    imbalance_sum: float = 0.0
    imbalance_max: float = 0.0
    wait_s: float = 0.0  # time the training loop waited inside next(loader)
    buffered_sum: int = 0
    buffered_max: int = 0  # samples held in memory (window, carry, planned steps)
    buffered_tokens_max: int = 0  # their real tokens
    read_ahead_max: int = 0  # samples read ahead of the window being planned
    read_ahead_tokens_max: int = 0

    def state_dict(self) -> Dict[str, Any]:
        """The counters as plain data (the run state's ``stats``)."""
        return dataclasses.asdict(self)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Set every counter from ``state_dict``'s output, in place (holders of this object see them).

        Example:
            >>> stats = EpochStats()
            >>> stats.load_state_dict(EpochStats(steps=3).state_dict())
            >>> stats.steps
            3
        """
        loaded = EpochStats(**state)
        for field in dataclasses.fields(EpochStats):
            setattr(self, field.name, getattr(loaded, field.name))

    def as_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["padding_ratio"] = 1.0 - self.real_tokens / self.padded_tokens if self.padded_tokens else 0.0
        out["mean_batch_size"] = self.samples / max(self.steps - self.ghost_steps, 1)
        out["rank_imbalance"] = self.imbalance_sum / self.steps if self.steps else 1.0
        out["mean_buffered"] = self.buffered_sum / self.steps if self.steps else 0.0
        out["ghost_fraction"] = self.ghost_steps / self.steps if self.steps else 0.0
        return out
