"""``composition="sampler"``: the sampler's order, one optimizer step's share at a time (the user's steps)."""

from __future__ import annotations

from typing import List

import numpy as np


class SamplerOrder:
    """Each step holds the next ``step_samples`` samples of the sampler's order: what the user's own loader
    puts in it (odb then only cuts it into micro-batches).

    Example:
        >>> SamplerOrder().compose(np.array([[3], [9], [4]]), 3, seed=0, epoch=0, block=0, first_step=0)
        [array([0, 1, 2])]
    """

    def __init__(self, block_steps: int = 1, warmup_steps: int = 0) -> None:
        self.block_steps = 1  # nothing to compose ahead: one step's share is read at a time

    def compose(self, lengths: np.ndarray, step_samples: int, *, seed: int, epoch: int, block: int,
                first_step: int) -> List[np.ndarray]:
        return [np.arange(len(lengths), dtype=np.int64)]
