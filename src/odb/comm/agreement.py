"""What every rank's loader must agree on: the options that change the plan, as per-option hashes.

Ranks plan their own windows and agree on step counts through odb's exchange; loaders
built with another budget, window, accumulation, loss scaling or seed on one rank would
exchange mismatched summaries (or a different number of messages). Every header of the
exchange carries one hash per option, so a mismatch stops all ranks at the first
exchange with a message naming the options.
"""

from __future__ import annotations

import hashlib
from typing import Any, Dict, List

import numpy as np

from odb.config import PLAN_OPTIONS, ODBConfig
from odb.comm.protocol import ODBOptionMismatch

# PLAN_OPTIONS change which batches come out; these change how steps are ordered or counted.
AGREED_OPTIONS = tuple(dict.fromkeys(PLAN_OPTIONS + ("image_patches_key", "seed", "label_key", "ignore_index",
                                                     "shift_labels")))


def agreed_values(cfg: ODBConfig, shuffle: bool) -> Dict[str, Any]:
    """The options every rank must share, by name (``shuffle``: whether batch order is shuffled).

    Example:
        >>> agreed_values(ODBConfig(token_budget=64), shuffle=False)["token_budget"]
        64
    """
    values = {name: getattr(cfg, name) for name in AGREED_OPTIONS if hasattr(cfg, name)}
    values["shuffle"] = bool(shuffle)
    return values


def fingerprint(values: Dict[str, Any]) -> np.ndarray:
    """One stable 63-bit hash per option (the same value gives the same hash in every process).

    Example:
        >>> a, b = fingerprint({"x": 1, "y": 2}), fingerprint({"x": 1, "y": 3})
        >>> (a == b).tolist()
        [True, False]
    """
    out = np.empty(len(values), dtype=np.int64)
    for k, (name, value) in enumerate(values.items()):
        digest = hashlib.blake2b(f"{name}={value!r}".encode("utf-8"), digest_size=8).digest()
        out[k] = int.from_bytes(digest, "little") >> 1
    return out


def check_agreement(gathered: np.ndarray, values: Dict[str, Any], rank: int) -> None:
    """Raise ``ODBOptionMismatch`` naming every option whose hash differs between ranks.

    ``gathered``: (world, options) hashes of every rank, in ``values``' order.

    Example:
        >>> values = {"token_budget": 64}
        >>> check_agreement(np.stack([fingerprint(values)] * 2), values, rank=0)  # agreed: nothing happens
    """
    differ = np.flatnonzero((gathered != gathered[rank]).any(axis=0))
    if not len(differ):
        return
    names = list(values)
    world_size = len(gathered)
    parts: List[str] = []
    for k in differ.tolist():
        others = np.flatnonzero(gathered[:, k] != gathered[rank, k]).tolist()
        parts.append(f"{names[k]}={values[names[k]]!r} here, another value on rank(s) {others}")
    raise ODBOptionMismatch(
        f"odb rank {rank} of {world_size}: the ranks' odb loaders were built with different options: "
        f"{'; '.join(parts)}. Rule: options that change the plan ({', '.join(names)}) must be equal on every "
        f"rank, or the ranks' steps cannot be aligned. Fix: build the loader with the same options on every rank "
        f"(agree on a rank-dependent value first, e.g. the smallest token_budget over ranks; pass the same seed).")
