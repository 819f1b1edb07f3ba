"""``composition="length_grouped"``: steps of length-similar samples, in a shuffled order.

transformers' ``group_by_length`` sorts megabatches of 50 steps by length and keeps them in that order
inside a megabatch, so adjacent steps' lengths follow each other; the field reports loss spikes and cycles
from it, which shuffling the steps removes at the same padding. Here a block of ``block_steps`` steps'
shares is sorted by length (the total over length dimensions, ties by order) and cut into steps of
``step_samples`` consecutive samples; the steps then run in an order drawn from ``(seed, epoch, block)``,
the same on every rank, so the k-th step of every rank is cut from the same quantile of its block and the
step is length-similar over all ranks too. ``warmup_steps``: the first steps of the run (epoch 0) run from
short to long instead (a sequence-length warm-up), each block's share of them ascending.

Example:
    >>> comp = LengthGrouped(block_steps=3)
    >>> steps = comp.compose(np.array([[9], [1], [5], [2], [8], [6]]), 2, seed=0, epoch=0, block=0, first_step=0)
    >>> sorted(sorted(s.tolist()) for s in steps)
    [[0, 4], [1, 3], [2, 5]]
    >>> warm = LengthGrouped(block_steps=3, warmup_steps=3)
    >>> [s.tolist() for s in warm.compose(np.array([[9], [1], [5], [2], [8], [6]]), 2, seed=0, epoch=0, block=0,
    ...                                   first_step=0)]
    [[1, 3], [2, 5], [4, 0]]
"""

from __future__ import annotations

from typing import List, Sequence

import numpy as np

DEFAULT_BLOCK_STEPS = 16


class LengthGrouped:
    """Length-similar steps of a block, block-shuffled (see the module docstring)."""

    def __init__(self, block_steps: int = DEFAULT_BLOCK_STEPS, warmup_steps: int = 0) -> None:
        if isinstance(block_steps, bool) or not isinstance(block_steps, int) or block_steps < 1:
            raise ValueError(f"composition_block_steps={block_steps!r}: the optimizer steps composed together must "
                             f"be an int >= 1. Fix: pass e.g. composition_block_steps={DEFAULT_BLOCK_STEPS}.")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 0:
            raise ValueError(f"composition_warmup_steps={warmup_steps!r}: the warm-up's optimizer steps must be an "
                             f"int >= 0. Fix: pass 0 (none) or the steps of a short-to-long warm-up.")
        self.block_steps, self.warmup_steps = block_steps, warmup_steps

    def compose(self, lengths: np.ndarray, step_samples: int, *, seed: int, epoch: int, block: int,
                first_step: int) -> List[np.ndarray]:
        total = np.asarray(lengths, dtype=np.int64).reshape(len(lengths), -1).sum(axis=1)
        n = len(total)
        by_length = np.lexsort((np.arange(n), total))  # shortest first, ties by order
        full = n // step_samples
        steps = [by_length[k * step_samples:(k + 1) * step_samples] for k in range(full)]
        rest = by_length[full * step_samples:]
        # Warm-up (epoch 0): this block's steps before warmup_steps run shortest first; the others shuffled.
        warm = min(max(self.warmup_steps - first_step, 0), full) if epoch == 0 else 0
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), int(block), 0x5EED])
        order = list(range(warm)) + [warm + int(k) for k in rng.permutation(full - warm)]
        out = [steps[k] for k in order]
        if len(rest):  # a block that ends the data: its partial step comes last (drop_last drops it)
            out.append(rest)
        return out


def adjacent_correlation(step_lengths: Sequence[float]) -> float:
    """The correlation of adjacent optimizer steps' mean lengths (lag-1 autocorrelation; 0.0 for fewer than 3
    steps or constant lengths): near 1 when steps come sorted by length, near 0 when their order is random.

    Example:
        >>> round(adjacent_correlation([1, 2, 3, 4, 5, 6]), 2), round(adjacent_correlation([1, 6, 2, 5, 3, 4]), 2)
        (1.0, -0.99)
    """
    x = np.asarray(step_lengths, dtype=np.float64)
    if len(x) < 3 or np.ptp(x) == 0:
        return 0.0
    a, b = x[:-1], x[1:]
    if a.std() == 0 or b.std() == 0:
        return 0.0
    return float(np.corrcoef(a, b)[0, 1])
