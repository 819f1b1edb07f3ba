"""``check_peers``: a digest of each batch, so the peers of a data-parallel replica can compare what they train.

Under a mesh every peer of a replica plans the same batches by construction (odb.comm.replicas). With
``check_peers=True`` each rank also hashes every batch it hands out, its tensors' bytes, shapes and dtypes
and its step info (all but the seconds the loop waited), and sends the digests with the next exchange that
carries its steps (the confirmation of online lengths, the supervised-token exchange of known lengths); the
exchange compares them between peers and every rank raises ``ODBPeerMismatch`` naming the two ranks at the
first step where they differ.

Example:
    >>> import torch
    >>> from odb.step_info import ODBStepInfo
    >>> info = ODBStepInfo(0, 0, 2, 2, 4, 4, 6, 6, 1.0, False)
    >>> a = batch_digest({"input_ids": torch.tensor([[1, 2, 3]])}, info)
    >>> a == batch_digest({"input_ids": torch.tensor([[1, 2, 3]])}, info), a == batch_digest(
    ...     {"input_ids": torch.tensor([[1, 2, 4]])}, info)
    (True, False)
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import numpy as np
import torch

from odb.step_info import ODBStepInfo

MASK = (1 << 63) - 1  # digests are sent as non-negative int64


def batch_digest(batch: Any, info: Optional[ODBStepInfo], skip_key: Optional[str] = None) -> int:
    """A 63-bit digest of ``batch`` (its tensors' bytes, shapes and dtypes, other leaves' reprs; ``skip_key``, the
    step info's key, left out) and of ``info`` but its ``loader_wait_s``; equal inputs, equal digests in any
    process."""
    h = hashlib.blake2b(digest_size=8)
    if info is not None:
        h.update(repr(dataclasses.replace(info, loader_wait_s=0.0)).encode())
    _update(h, batch, skip_key)
    return int.from_bytes(h.digest(), "little") & MASK


def digests_of(batches: Sequence[Any], key: str) -> int:
    """One digest of several batches that carry their step info under ``key`` (the steps one confirmation
    covers)."""
    h = hashlib.blake2b(digest_size=8)
    for batch in batches:
        info = batch.get(key) if isinstance(batch, Mapping) else getattr(batch, key, None)
        h.update(batch_digest(batch, info, key).to_bytes(8, "little"))
    return int.from_bytes(h.digest(), "little") & MASK


def _update(h: Any, obj: Any, skip_key: Optional[str]) -> None:
    if isinstance(obj, torch.Tensor):
        t = obj.detach().cpu().contiguous()
        h.update(f"T{tuple(t.shape)}{t.dtype}".encode())
        if t.numel():
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool else
                     t.numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        h.update(f"A{obj.shape}{obj.dtype}".encode())
        h.update(np.ascontiguousarray(obj).tobytes())
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=repr):
            if k != skip_key:
                h.update(repr(k).encode())
                _update(h, obj[k], skip_key)
    elif isinstance(obj, (list, tuple)):
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _update(h, v, skip_key)
    elif isinstance(obj, ODBStepInfo):
        return
    else:
        h.update(repr(obj).encode())
