"""One optimizer step's figures in the scale section: its micro-batches per rank and their step efficiency.

``MicroBatch`` and ``step_efficiency`` are odb.bench.scale's (its docstring defines the figures), shared with
odb.bench.scale_mesh; ``draw`` picks a cell's lengths from a pool.

    >>> step_efficiency([[MicroBatch(100, 100, 100)], [MicroBatch(100, 100, 100)]])["ddp"]
    1.0
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional

import numpy as np

TOKEN_BUDGET = 4096
OVERHEAD = 256  # micro_batch_cost, in tokens


class MicroBatch(NamedTuple):
    """One rank's micro-batch: padded tokens (samples x longest; a packed row: its real tokens), real
    tokens and its longest sample. A ghost micro-batch is ``None``."""

    padded: int
    real: int
    longest: int


Step = List[List[Optional[MicroBatch]]]  # step[rank][micro-step]


def step_efficiency(step: Step, overhead: float = OVERHEAD, cap: int = TOKEN_BUDGET) -> Dict[str, float]:
    """DDP and FSDP step efficiency and the bound of one optimizer step (the module's docstring defines them).

    ``step[r]``: rank r's micro-batches in micro-step order, ``None`` for a ghost (the overhead alone).
    ``cap_bound``: the bound with the micro-batches the memory cap forces: (R / W + overhead) / (max(R / W,
    longest) + ceil(ceil(R / cap) / W) x overhead). Every rank runs the same number of micro-steps (ghosts
    included) and no micro-batch holds more than ``cap`` real tokens, so some rank runs at least ceil(R / cap) / W
    of them: no plan within the cap does better (BatchRebalanceSampler, which knows no cap, may).

    Example:
        >>> mb = MicroBatch
        >>> e = step_efficiency([[mb(200, 150, 100)], [mb(100, 100, 100)]], overhead=256)
        >>> round(e["ddp"], 4), round(e["fsdp"], 4), e["bound"]    # (250 / 2 + 256) / (200 + 256)
        (0.8355, 0.8355, 1.0)
        >>> round(step_efficiency([[mb(100, 100, 100), None], [mb(100, 100, 100), mb(100, 100, 100)]],
        ...                       overhead=256)["ddp"], 4)          # (300 / 2 + 256) / (2 x 100 + 2 x 256)
        0.5702
    """
    world = len(step)
    real = sum(m.real for rank in step for m in rank if m is not None)
    longest = max((m.longest for rank in step for m in rank if m is not None), default=0)
    fair = real / world + overhead
    slowest = max(sum((m.padded if m is not None else 0) + overhead for m in rank) for rank in step)
    micro_steps = max(len(rank) for rank in step)
    fsdp = sum(max(((rank[j].padded if j < len(rank) and rank[j] is not None else 0) + overhead)
                   for rank in step) for j in range(micro_steps))
    forced = math.ceil(math.ceil(real / cap) / world) if real else 1
    return {"ddp": fair / slowest, "fsdp": fair / fsdp, "bound": fair / max(fair, longest + overhead),
            "cap_bound": fair / (max(real / world, longest) + max(forced, 1) * overhead)}


def draw(pool: np.ndarray, n: int, seed: int) -> np.ndarray:
    """``n`` lengths from ``pool``: a seeded subsample without replacement where the pool holds that many,
    else drawn with replacement."""
    rng = np.random.default_rng(seed)
    return pool[rng.choice(len(pool), size=n, replace=n > len(pool))].astype(np.int64)
