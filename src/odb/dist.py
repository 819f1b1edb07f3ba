"""The one module that touches torch.distributed: odb's metadata exchange.

A CPU (gloo) group, created once per (default group, timeout) in the main process,
carries a few integers per window: a header (groups planned, groups that must be
emitted, data ended, seed) and then per-step summaries (cost, samples, loss tokens).
No sample data crosses ranks.
"""

from __future__ import annotations

import datetime
from typing import Any, Dict, Tuple

import numpy as np
import torch
import torch.distributed as dist

_GROUPS: Dict[Tuple[int, float], Any] = {}


class ODBExchangeError(RuntimeError):
    """A rank did not take part in odb's metadata exchange (it died, stalled or diverged)."""


def world() -> Tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def metadata_group(timeout_s: float, group: Any = None) -> Any:
    """The gloo group for odb's exchange; a collective call the first time (all ranks)."""
    if group is not None:
        return group
    key = (id(dist.group.WORLD), float(timeout_s))
    if key not in _GROUPS:
        _GROUPS[key] = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return _GROUPS[key]


class RankExchange:
    """all_gather of small int64 arrays over the metadata group, with a clear error."""

    def __init__(self, timeout_s: float, group: Any = None) -> None:
        if group is not None:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.world_size = world()
        self.timeout_s = timeout_s
        self.group = metadata_group(timeout_s, group) if self.world_size > 1 else None

    def all_gather(self, values: np.ndarray, where: str) -> np.ndarray:
        """(world, *values.shape) array of every rank's values (same shape on all ranks)."""
        values = np.ascontiguousarray(values, dtype=np.int64)
        local = torch.as_tensor(values.reshape(-1))
        out = torch.empty(self.world_size * local.numel(), dtype=torch.int64)
        try:
            dist.all_gather_into_tensor(out, local, group=self.group)
        except Exception as err:  # gloo raises RuntimeError subclasses with the peer's address
            raise ODBExchangeError(
                f"odb rank {self.rank} of {self.world_size}: the metadata exchange at {where} failed or waited "
                f"more than exchange_timeout_s={self.timeout_s}: another rank died, stalled or stopped iterating "
                f"its odb loader ({type(err).__name__}: {err}). Fix: check the other ranks' logs; every rank "
                f"must iterate its odb loaders in the same order; raise exchange_timeout_s for very slow "
                f"steps.") from err
        return out.numpy().reshape((self.world_size,) + values.shape)
