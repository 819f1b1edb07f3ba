"""Tables precomputed once per step for the padded layout's runs (``runs._Runs``): the sorted samples as blocks
of one padded length (``Blocks``), a sparse table of range maxima with the side costs' prefix sums
(``RangeMax``), and per-sample block ends."""

from __future__ import annotations

import dataclasses
from typing import List, Optional

import numpy as np

from odb.plan.costs.cost import CostModel


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The sorted samples as blocks of one padded length (one dimension, no side costs), for the block estimate
    of a greedy cut (``_Runs.estimate``)."""

    start: np.ndarray  # (blocks,) each block's first sample
    end: np.ndarray  # one past its last
    g: np.ndarray  # its samples' padded length
    fit: np.ndarray  # copies of one of its samples that fit a batch (not cut short by the samples left)

    @classmethod
    def of(cls, g: np.ndarray, pad: np.ndarray, cost: CostModel) -> Blocks:
        change = np.flatnonzero(np.diff(g)) + 1
        start = np.concatenate(([0], change)).astype(np.int64)
        return cls(start, np.concatenate((change, [len(g)])).astype(np.int64), g[start],
                   cost.copies_that_fit_unrounded(pad[start]))


@dataclasses.dataclass(frozen=True)
class RangeMax:
    """What run costs need with several dimensions or side costs (``_Runs.cost``, ``_Runs.cost_of``): a sparse
    table of the padded lengths' range maxima per dimension and the prefix sums of the side costs."""

    table: List[np.ndarray]  # per dimension: at l * n + i the max of pad[i : i + 2**l] (cut at n)
    table_lists: List[List[float]]  # the same as Python lists
    cum_extra: Optional[np.ndarray]  # (n + 1,) prefix sums of the side costs; None: no side costs
    cum_extra_list: Optional[List[float]]

    @classmethod
    def of(cls, pad: np.ndarray, extra: Optional[np.ndarray], longest: int) -> RangeMax:
        """``longest``: the longest run (two overlapping levels cover a run up to it)."""
        n, dims = pad.shape
        levels = [pad.astype(np.float64)]
        while (1 << len(levels)) <= max(longest, 1):
            half = 1 << (len(levels) - 1)
            nxt = levels[-1].copy()
            nxt[:n - half] = np.maximum(nxt[:n - half], nxt[half:])
            levels.append(nxt)
        table = [np.ascontiguousarray(np.stack(levels)[:, :, d]).ravel() for d in range(dims)]
        cum_extra = None if extra is None else np.concatenate(([0.0], np.cumsum(extra)))
        return cls(table, [t.tolist() for t in table], cum_extra, None if cum_extra is None else cum_extra.tolist())


def block_ends(g: np.ndarray, cnt: np.ndarray) -> np.ndarray:
    """For each sample, the end of the block of consecutive samples with its length and its ``cnt``.

    Example:
        >>> block_ends(np.array([9, 9, 9, 5, 5]), np.array([2, 2, 1, 3, 3])).tolist()
        [2, 2, 3, 5, 5]
    """
    n = len(g)
    change = np.flatnonzero((g[1:] != g[:-1]) | (cnt[1:] != cnt[:-1])) + 1
    ends = np.append(change, n)
    return np.repeat(ends, np.diff(np.concatenate(([0], ends)))).astype(np.int64)


def fit_is_count(blocks: Blocks, cnt: np.ndarray) -> bool:
    """Whether every sample's ``cnt`` is its block's ``fit`` cut by the samples left (no other cap applies)."""
    n = len(cnt)
    fit = np.repeat(blocks.fit, blocks.end - blocks.start)
    return bool(np.array_equal(cnt, np.minimum(fit, np.arange(n, 0, -1))))
