"""One context-parallel rank's shard of a batch: its tokens, with positions and sample boundaries still valid.

Under context parallelism (CP) each of the cp ranks of a replica holds a part of every sequence. The
load-balanced split of causal attention (torch's ``context_parallel``, Megatron's CP) cuts each sequence into
2 x cp chunks and gives rank i the chunks i and 2 x cp - 1 - i, so every rank holds as many early (cheap)
as late (costly) tokens. odb pads every length to that multiple (``ODBConfig.length_multiple``: padded rows
by ``odb.PadToBucket``, each sample of a packed row by ``PackedCollate(sample_multiple=...)``), so every
sequence splits evenly.

``context_shard`` cuts a batch so: a padded batch row by row (each row one sequence), a packed row sample by
sample (Megatron's "THD" layout: each sample of the row split on its own), with ``position_ids`` holding each
token's position in its own sequence and, for a packed row, ``cu_seq_lens_q`` / ``cu_seq_lens_k`` the
shard's sample boundaries (each sample's length / cp) and ``max_length_q`` / ``max_length_k`` its longest.
A model whose loss and positions depend on each token's own position (rotary embeddings, a per-token loss)
then computes on the shard what it computes on those tokens of the whole batch; attention across the shards
is the CP framework's (ring attention).

Example (a packed row of samples of 4 and 8 tokens, cp 2, this is rank 1's shard):
    >>> import torch
    >>> batch = {"input_ids": torch.arange(12)[None], "labels": torch.arange(12)[None],
    ...          "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]])}
    >>> shard = context_shard(batch, rank=1, cp=2)
    >>> shard["input_ids"].tolist(), shard["position_ids"].tolist(), shard["cu_seq_lens_q"].tolist()
    ([[1, 2, 6, 7, 8, 9]], [[1, 2, 2, 3, 4, 5]], [0, 2, 6])
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, List, Sequence

import torch

SEQUENCE_KEYS = ("input_ids", "labels", "attention_mask", "position_ids", "token_type_ids", "seq_idx")


def context_shard(batch: Mapping, rank: int, cp: int, *, load_balanced: bool = True,
                  keys: Sequence[str] = SEQUENCE_KEYS) -> Dict[str, Any]:
    """Rank ``rank``'s shard (of ``cp``) of a collated batch: its ``keys`` tensors ((B, L), the sequence on dim 1)
    cut along the sequence; a batch of one row whose ``position_ids`` restart is a packed row, cut sample by
    sample. Other entries are kept as they are. Raises, with the fix, where a sequence does not split evenly.
    ``load_balanced=False``: rank i takes the i-th of cp contiguous chunks (DeepSpeed-Ulysses style)."""
    if not isinstance(batch, Mapping) or "input_ids" not in batch:
        raise TypeError(f"context_shard got {type(batch).__name__}: it cuts a dict batch with input_ids. Fix: pass "
                        f"the collated dict batch.")
    if not 0 <= rank < cp:
        raise ValueError(f"context_shard got rank={rank} for cp={cp}. Fix: pass the rank in the CP group, 0..{cp - 1}.")
    ids = batch["input_ids"]
    rows, width = int(ids.shape[0]), int(ids.shape[1])
    positions = batch.get("position_ids")
    if positions is None:
        positions = torch.arange(width, dtype=torch.int64).expand(rows, width)
    packed = rows == 1 and bool((positions[0, 1:] == 0).any()) if width > 1 else False
    sizes = _sample_sizes(positions[0]) if packed else [width]
    chunks = 2 * cp if load_balanced else cp
    bad = [n for n in sizes if n % chunks]
    if bad:
        what = "samples of the packed row" if packed else "rows"
        raise ValueError(f"context_shard: {what} of {bad[:4]} tokens do not split into {chunks} equal chunks (cp={cp}"
                         f"{', load-balanced' if load_balanced else ''}). Rule: every sequence's length is a multiple "
                         f"of {chunks}. Fix: odb pads to it under context_parallel={cp} (ODBConfig.length_multiple): "
                         f"keep odb's collate wrapping (PadToBucket), or PackedCollate(sample_multiple={chunks}) for "
                         f"packed rows.")
    index = _shard_index(sizes, rank, cp, load_balanced)
    out = dict(batch)
    out["position_ids"] = positions[:, index]
    for key in keys:
        value = batch.get(key)
        if key != "position_ids" and isinstance(value, torch.Tensor) and value.dim() >= 2 and \
                int(value.shape[1]) == width:
            out[key] = value[:, index]
    if packed:
        cu = torch.tensor([0] + [n // cp for n in sizes], dtype=torch.int64).cumsum(0).to(torch.int32)
        for side in ("q", "k"):
            out[f"cu_seq_lens_{side}"] = cu
            out[f"max_length_{side}"] = max(n // cp for n in sizes)
    return out


def _sample_sizes(positions: torch.Tensor) -> List[int]:
    """Lengths of the samples of a packed row from its restarting positions."""
    starts = torch.nonzero(positions == positions[0]).flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    ends = starts[1:] + [len(positions)]
    return [e - s for s, e in zip(starts, ends)]


def _shard_index(sizes: Sequence[int], rank: int, cp: int, load_balanced: bool) -> torch.Tensor:
    """Token positions of rank ``rank``'s shard, sequence after sequence."""
    parts = []
    start = 0
    for n in sizes:
        if load_balanced:
            chunk = n // (2 * cp)
            for c in (rank, 2 * cp - 1 - rank):
                parts.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
        else:
            chunk = n // cp
            parts.append(torch.arange(start + rank * chunk, start + (rank + 1) * chunk))
        start += n
    return torch.cat(parts)
