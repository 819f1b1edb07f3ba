"""A sampler's order dealt to ranks in batches, as Accelerate shards a trainer's DataLoader.

A trainer that runs a global order on every rank (transformers' ``LengthGroupedSampler`` for
``group_by_length``, a sampler without ranks) leaves the sharding to Accelerate, which deals the
batches of ``batch_size`` consecutive indices to the ranks in turn: rank r trains batches r, r + W,
r + 2W, ... ``BatchShardSampler`` gives rank r exactly those indices, in that order, so an odb loader
with ``global_batch_size = batch_size x accumulation x W`` holds in every optimizer step the samples
that trainer's step holds, whatever it made of them (length-grouped steps stay length-grouped), and
only cuts them into micro-batches. At the end of the data a rank may hold fewer batches than another
(odb's join runs the ranks together); no index is repeated or dropped.

Example:
    >>> parts = [list(BatchShardSampler(range(10), batch_size=2, num_replicas=2, rank=r)) for r in (0, 1)]
    >>> parts
    [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7]]
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List

from torch.utils.data import Sampler


class BatchShardSampler(Sampler[int]):
    """Rank ``rank`` of ``num_replicas``'s share of ``sampler``'s order: its batches of ``batch_size`` consecutive
    indices r, r + W, ... (see the module docstring). ``set_epoch`` reaches the wrapped sampler."""

    def __init__(self, sampler: Iterable[int], batch_size: int, num_replicas: int, rank: int) -> None:
        for name, value, low in (("batch_size", batch_size, 1), ("num_replicas", num_replicas, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"BatchShardSampler got {name}={value!r}: an int >= {low}. Fix: pass the trainer's "
                                 f"per-device batch size and the number of data-parallel ranks.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"BatchShardSampler got rank={rank!r} with num_replicas={num_replicas}: the rank must be "
                             f"in [0, num_replicas). Fix: pass this process's data-parallel rank.")
        self.sampler, self.batch_size, self.num_replicas, self.rank = sampler, batch_size, num_replicas, rank

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order: List[Any] = list(self.sampler)
        b, w = self.batch_size, self.num_replicas
        for start in range(self.rank * b, len(order), b * w):
            yield from order[start:start + b]

    def __len__(self) -> int:
        n = len(self.sampler)  # type: ignore[arg-type]
        full, rest = divmod(n, self.batch_size * self.num_replicas)
        return full * self.batch_size + min(max(rest - self.rank * self.batch_size, 0), self.batch_size)
