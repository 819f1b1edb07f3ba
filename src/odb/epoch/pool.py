"""The samples an epoch holds between reading and emitting, with what odb measured of them.

A sample is known by its position in the epoch's order (unique even when the sampler
repeats a dataset index); its dataset index rides along for the step info.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np

from odb.data.source import Meta


class SamplePool:
    """Samples by position (window, carry, planned steps) with their metas and dataset indices.

    Example:
        >>> pool = SamplePool()
        >>> pool.add(7, "s", ((5,), 4, 0), index=3)
        >>> pool.lengths([7]).tolist(), pool.loss_tokens([7]), pool.indices([7])
        ([[5]], 4, [3])
    """

    def __init__(self) -> None:
        self._samples: Dict[int, Any] = {}
        self._meta: Dict[int, Meta] = {}
        self._index: Dict[int, int] = {}
        self.tokens = 0  # real tokens of the samples held

    def __len__(self) -> int:
        return len(self._samples)

    def __contains__(self, sid: int) -> bool:
        return sid in self._meta

    def add(self, sid: int, sample: Any, meta: Meta, index: int) -> None:
        """Hold the sample at position ``sid`` of the epoch's order (dataset index ``index``)."""
        if sid in self._meta:  # positions are unique by construction: this is odb's own bug
            raise RuntimeError(f"odb internal error: position {sid} of the epoch's order (dataset index {index}) "
                               f"was read twice. Fix: report it with the sampler and dataset used.")
        self._samples[sid] = sample
        self._meta[sid] = meta
        self._index[sid] = index
        self.tokens += sum(meta[0])

    def meta(self, sid: int) -> Meta:
        return self._meta[sid]

    def indices(self, ids: Iterable[int]) -> List[int]:
        """Dataset indices of the samples at these positions."""
        return [self._index[int(i)] for i in ids]

    def dims(self) -> int:
        meta = next(iter(self._meta.values()), None)
        return len(meta[0]) if meta else 1

    def lengths(self, ids: Iterable[int]) -> np.ndarray:
        rows = [self._meta[int(i)][0] for i in ids]
        return np.array(rows, dtype=np.int64).reshape(len(rows), -1) if rows else \
            np.empty((0, self.dims()), dtype=np.int64)

    def side(self, ids: Iterable[int], needed: bool = True) -> Optional[np.ndarray]:
        """(n, 2) image patches and supervised tokens of these samples: the planner's side counts
        (odb.plan.costs.cost.split_side); None when not ``needed`` (no patch cap, no side cost).

        Example:
            >>> pool = SamplePool(); pool.add(0, "s", ((5,), 4, 16), index=0); pool.side([0]).tolist()
            [[16, 4]]
        """
        if not needed:
            return None
        return np.array([[self._meta[int(i)][2], self._meta[int(i)][1]] for i in ids], dtype=np.int64).reshape(-1, 2)

    def loss_tokens(self, ids: Iterable[int]) -> int:
        return sum(self._meta[int(i)][1] for i in ids)

    def real_tokens(self, ids: Iterable[int]) -> int:
        return sum(sum(self._meta[int(i)][0]) for i in ids)

    def longest(self, ids: np.ndarray) -> int:
        return max(sum(self._meta[int(i)][0]) for i in ids)

    @staticmethod
    def first_position(ids: np.ndarray) -> int:
        return int(min(ids))

    def pop(self, ids: Iterable[int]) -> Tuple[List[Any], List[Meta]]:
        """Remove a group that is being emitted: its samples and metas."""
        samples, metas = [], []
        for i in ids:
            i = int(i)
            samples.append(self._samples.pop(i))
            meta = self._meta.pop(i)
            self._index.pop(i)
            self.tokens -= sum(meta[0])
            metas.append(meta)
        return samples, metas

    def forget(self, ids: Iterable[int]) -> None:
        """Drop samples that will never be emitted (skipped or dropped)."""
        for i in ids:
            i = int(i)
            if i in self._meta:
                self.tokens -= sum(self._meta.pop(i)[0])
                self._samples.pop(i)
                self._index.pop(i)

    def lowest(self) -> Optional[int]:
        """The first position of this rank's order held (None when none is; samples planned here from other
        ranks have negative keys: odb.epoch.global_step)."""
        return min((sid for sid in self._meta if sid >= 0), default=None)

    def sample(self, sid: int) -> Optional[Any]:
        return self._samples.get(sid)


def side_needed(cfg: Any) -> bool:
    """Whether the planner needs the samples' side counts (``SamplePool.side``): a patch cap, a side cost,
    or token_budget="auto" (whose plans may price supervised tokens and patches from one window to the next).

    Example:
        >>> from odb.config import ODBConfig
        >>> side_needed(ODBConfig(token_budget=64)), side_needed(ODBConfig(token_budget=64, loss_token_cost=0.5))
        (False, True)
    """
    return bool(cfg.auto or cfg.image_patches_key is not None or cfg.image_patch_cost or cfg.loss_token_cost)
