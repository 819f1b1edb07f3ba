"""The one module that touches torch.distributed: odb's metadata exchange.

A CPU (gloo) group of its own for every epoch of every loader, created on the main
thread when the epoch's iterator is built (every rank builds its loaders' iterators in
the same order), carries a few integers per window from the loader's background thread:
a header (groups planned, groups that must be emitted, data ended, seed) and then
per-step summaries (cost, samples, loss tokens). A group per epoch means two loaders
alive at once never interleave collectives on one group, and an epoch abandoned while
its thread waits in an exchange cannot disturb the next one. No sample data crosses ranks.
"""

from __future__ import annotations

import datetime
from typing import Any, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist


class ODBExchangeError(RuntimeError):
    """A rank did not take part in odb's metadata exchange (it died, stalled or diverged)."""


def world() -> Tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def new_metadata_group(timeout_s: float) -> Any:
    """A fresh gloo group over all ranks: a collective call (every rank, same order, main thread)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))


def release_group(group: Any) -> None:
    """Let go of a group made by ``new_metadata_group`` whose exchanges have all finished (local)."""
    try:
        dist.destroy_process_group(group)
    except Exception:  # the default group may already be gone (shutdown); nothing to release then
        pass


class RankExchange:
    """all_gather of small int64 arrays over the metadata group, with a clear error."""

    def __init__(self, timeout_s: float, group: Any = None) -> None:
        self.owns_group = group is None
        if group is not None:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.world_size = world()
        self.timeout_s = timeout_s
        self.group: Optional[Any] = group
        if self.owns_group and self.world_size > 1:
            self.group = new_metadata_group(timeout_s)

    def release(self) -> None:
        """Release the group, if this exchange made it (call once its exchanges are over)."""
        if self.owns_group and self.group is not None:
            release_group(self.group)
            self.group = None

    def all_gather(self, values: np.ndarray, where: str) -> np.ndarray:
        """(world, *values.shape) array of every rank's values (same shape on all ranks)."""
        values = np.ascontiguousarray(values, dtype=np.int64)
        local = torch.as_tensor(values.reshape(-1))
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, local, group=self.group)
        except Exception as err:  # gloo raises RuntimeError subclasses with the peer's address
            raise ODBExchangeError(
                f"odb rank {self.rank} of {self.world_size}: the metadata exchange at {where} failed or waited "
                f"more than exchange_timeout_s={self.timeout_s}: another rank died, stalled or stopped iterating "
                f"its odb loader ({type(err).__name__}: {err}). Fix: check the other ranks' logs; every rank "
                f"must iterate its odb loaders in the same order; raise exchange_timeout_s for very slow "
                f"steps.") from err
        return torch.stack(parts).numpy().reshape((self.world_size,) + values.shape)
