"""Rollout rows moved between ranks for a global rollout plan (``odb.plan.rollouts.across_ranks``).

Under ``step_plan="global"`` a rank trains rows of other ranks' slices. Each rank sends every other
rank the rows that rank trains, once (``pack_rows``: the rows' per-row tensors, trimmed to their own
longest prompt and completion, on the CPU), through odb's one mover of objects, the loader's own
(``odb.comm.mover.move_objects``: pickled, one gather of sizes and one gloo all-to-all of bytes). Each micro-batch is then built from the rank's own rows and
the rows it received (``micro_batch``), each key as ``odb.integrations.trl.rl_rows.RolloutKeys`` lists
it: prompt values re-padded on the left and completion values on the right to the micro-batch's
widths, with TRL's own padding value of that key (it lies outside ``prompt_mask`` /
``completion_mask``, which every loss term and odb's forward mask out), per-row values kept as they
are, shared values (``num_items_in_batch``, the same on every rank) the rank's own; dtypes kept,
received tensors put on the device of the rank's own.

Example (two ranks' slices in one process: rank 1 trains rank 0's row 1 with its own row 0):
    >>> import torch
    >>> def slice_(p, c):
    ...     return {"prompt_ids": torch.tensor(p), "prompt_mask": (torch.tensor(p) > 0).long(),
    ...             "completion_ids": torch.tensor(c), "completion_mask": (torch.tensor(c) > 0).long(),
    ...             "advantages": torch.tensor([1.0, -1.0]), "num_items_in_batch": torch.tensor(9)}
    >>> rank0 = slice_([[0, 5], [6, 7]], [[3, 3, 3], [4, 0, 0]])
    >>> rank1 = slice_([[0, 0, 8], [0, 9, 9]], [[5, 0], [6, 6]])
    >>> data = pack_rows(rank0, np.array([1]))      # what rank 0 sends rank 1
    >>> got = {0: (unpack_rows(data, rank1), np.array([1]))}
    >>> piece = micro_batch(rank1, got, rank=1, n=2, rows=np.array([1, 2]), prompt_width=2, completion_width=1)
    >>> piece["prompt_ids"].tolist(), piece["completion_ids"].tolist(), piece["advantages"].tolist()
    ([[6, 7], [0, 8]], [[4], [5]], [-1.0, 1.0])
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import torch

from odb.comm.mover import move_objects
from odb.integrations.trl.rl_rows import PROMPT, ROW, SHARED, TRL_KEYS, RolloutKeys, rollout_lengths, take_rows

__all__ = ["Received", "micro_batch", "move_rows", "pack_rows", "unpack_rows"]

Received = Dict[int, Tuple[Mapping[str, Any], np.ndarray]]  # origin rank -> (its rows' values, their rows)


def pack_rows(inputs: Mapping[str, Any], rows: np.ndarray, keys: RolloutKeys = TRL_KEYS) -> Dict[str, torch.Tensor]:
    """What is sent of ``rows`` (indices into the slice ``inputs``): every per-row value, trimmed to the rows' own
    longest prompt and completion, on the CPU (``odb.comm.mover`` pickles a trimmed view's own elements only)."""
    prompt, completion = rollout_lengths(inputs)
    rows = np.asarray(rows, dtype=np.int64)
    wide_p, wide_c = int(max(prompt[rows].max(), 1)), int(max(completion[rows].max(), 1))
    piece = take_rows(inputs, rows, wide_p, wide_c, keys)
    return {k: v.detach().to("cpu") for k, v in piece.items() if v is not None and keys.kind(k) != SHARED}


def unpack_rows(values: Mapping[str, Any], like: Mapping[str, Any]) -> Dict[str, torch.Tensor]:
    """The values ``pack_rows`` took, each on the device of the same value of ``like`` (the rank's own slice)."""
    return {k: v.to(like[k].device) if isinstance(like.get(k), torch.Tensor) else v for k, v in values.items()}


def _pad(value: torch.Tensor, width: int, left: bool, fill: float) -> torch.Tensor:
    """``value`` (rows, w <= width) padded with ``fill`` to ``width`` columns, on the left or the right."""
    more = width - value.shape[1]
    if more <= 0:
        return value
    pad = value.new_full((value.shape[0], more) + tuple(value.shape[2:]), fill)
    return torch.cat([pad, value] if left else [value, pad], dim=1)


def micro_batch(local: Mapping[str, Any], received: Received, rank: int, n: int, rows: np.ndarray,
                prompt_width: int, completion_width: int, keys: RolloutKeys = TRL_KEYS) -> Dict[str, Any]:
    """The micro-batch of flat ``rows`` (``origin * n + row``) on rank ``rank``: its own rows from ``local``, the
    others from ``received`` (origin -> (values, the origin's rows they hold, ascending)), prompt values
    ``prompt_width`` wide (left-padded), completion values ``completion_width`` wide (right-padded), each key
    as ``keys`` lists it."""
    rows = np.asarray(rows, dtype=np.int64)
    parts = []
    for origin in np.unique(rows // n).tolist():
        mine = rows[rows // n == origin] - origin * n
        if origin == rank:
            parts.append(take_rows(local, mine, prompt_width, completion_width, keys))
            continue
        values, held = received[origin]
        parts.append(take_rows(values, np.searchsorted(held, mine), prompt_width, completion_width, keys))
    out: Dict[str, Any] = {}
    for key, value in local.items():
        kind = keys.kind(key)
        if kind == SHARED or value is None:
            out[key] = value
            continue
        pieces = [p[key] for p in parts]
        if kind != ROW:
            width = prompt_width if kind == PROMPT else completion_width
            pieces = [_pad(p, width, kind == PROMPT, keys.pad(key)) for p in pieces]
        if len({tuple(p.shape[1:]) for p in pieces}) > 1:
            raise ValueError(f"odb rank {rank}: rollout rows moved between ranks hold {key!r} of shapes "
                             f"{[tuple(p.shape) for p in pieces]}. Rule: a value is per row, per prompt column or "
                             f"per completion column alike on every rank. Fix: step_plan='rank' (rows stay on "
                             f"their rank).")
        out[key] = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
    return out


def move_rows(exchange: Any, inputs: Mapping[str, Any], plan: Any, rank: int, where: str,
              keys: RolloutKeys = TRL_KEYS) -> Tuple[Received, int, int]:
    """Send every other rank d the rows of this rank's slice that it trains (``plan.sent(rank, d)``) and receive
    the rows this rank trains from theirs: (received, rows received, bytes received). A collective when the
    plan moves rows (every rank computes the same plan, so all call it or none needs to); nothing crosses
    when it moves none."""
    world = plan.world
    if plan.moved_rows == 0:
        return {}, 0, 0
    outgoing: List[Optional[Dict[str, torch.Tensor]]] = []
    for d in range(world):
        rows = plan.sent(rank, d)
        outgoing.append(pack_rows(inputs, rows, keys) if d != rank and len(rows) else None)
    incoming, counts = move_objects(exchange, outgoing, where)  # the loader's own mover of samples
    received: Received = {}
    rows_in = 0
    for origin in range(world):
        held = plan.sent(origin, rank)
        if origin == rank or not len(held):
            continue
        received[origin] = (unpack_rows(incoming[origin], inputs), held)
        rows_in += len(held)
    return received, rows_in, counts.received_bytes
