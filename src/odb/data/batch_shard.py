"""A sampler's order dealt to ranks in batches, as Accelerate shards a trainer's DataLoader.

A trainer that runs a global order on every rank (transformers' ``LengthGroupedSampler`` for
``group_by_length``, a sampler without ranks) leaves the sharding to Accelerate, which deals the
batches of ``batch_size`` consecutive indices to the ranks in turn: rank r trains batches r, r + W,
r + 2W, ... ``BatchShardSampler`` gives rank r exactly those indices, in that order, so an odb loader
with ``global_batch_size = batch_size x accumulation x W`` holds in every optimizer step the samples
that trainer's step holds, whatever it made of them (length-grouped steps stay length-grouped), and
only cuts them into micro-batches. At the end of the data a rank may hold fewer batches than another
(odb's join runs the ranks together) and no index is repeated, as under Accelerate's ``even_batches=False``.
The two other ways Accelerate ends an epoch are options: ``drop_last=True`` drops the last round of
batches unless every rank gets a whole batch in it (a DataLoader with ``drop_last=True``);
``even_batches=True`` (Accelerate's default, on several processes) fills that round with indices from
the start of the order, so that every rank gets as many whole batches (those indices are then trained
twice in the epoch).

Example:
    >>> parts = [list(BatchShardSampler(range(10), batch_size=2, num_replicas=2, rank=r)) for r in (0, 1)]
    >>> parts
    [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7]]
    >>> [list(BatchShardSampler(range(10), batch_size=2, num_replicas=2, rank=r, drop_last=True)) for r in (0, 1)]
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    >>> [list(BatchShardSampler(range(10), 2, 2, r, even_batches=True)) for r in (0, 1)]
    [[0, 1, 4, 5, 8, 9], [2, 3, 6, 7, 0, 1]]
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, List

from torch.utils.data import Sampler


class BatchShardSampler(Sampler[int]):
    """Rank ``rank`` of ``num_replicas``'s share of ``sampler``'s order: its batches of ``batch_size`` consecutive
    indices r, r + W, ... (see the module docstring), without an incomplete last round with ``drop_last``, or with
    that round filled from the order's start with ``even_batches``. ``set_epoch`` reaches the wrapped sampler.
    ``replayable``: the wrapped sampler gives an epoch's order again, also in a new process, once set to that
    epoch (a function of its settings and the epoch), so a loader can resume in the middle of an epoch; a
    sampler odb knows to be one (``SequentialSampler``, ``odb.ShardSampler``...) needs no flag."""

    def __init__(self, sampler: Iterable[int], batch_size: int, num_replicas: int, rank: int,
                 drop_last: bool = False, even_batches: bool = False, replayable: bool = False) -> None:
        for name, value, low in (("batch_size", batch_size, 1), ("num_replicas", num_replicas, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"BatchShardSampler got {name}={value!r}: an int >= {low}. Fix: pass the trainer's "
                                 f"per-device batch size and the number of data-parallel ranks.")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise ValueError(f"BatchShardSampler got rank={rank!r} with num_replicas={num_replicas}: the rank must be "
                             f"in [0, num_replicas). Fix: pass this process's data-parallel rank.")
        self.sampler, self.batch_size, self.num_replicas, self.rank = sampler, batch_size, num_replicas, rank
        self.drop_last, self.even_batches, self.replayable = bool(drop_last), bool(even_batches), bool(replayable)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        order: List[Any] = list(self.sampler)
        b, w = self.batch_size, self.num_replicas
        end = len(order) - len(order) % (b * w) if self.drop_last else len(order)
        if self.even_batches and not self.drop_last and order:
            start = order[:b * w]  # the first round, repeated as often as the last one needs
            order += (start * -(-b * w // len(start)))[:-len(order) % (b * w)]
            end = len(order)
        for start in range(self.rank * b, end, b * w):
            yield from order[start:start + b]

    def __len__(self) -> int:
        return self.share(self.rank)

    def share(self, rank: int) -> int:
        """How many indices rank ``rank`` holds in an epoch (rank 0 holds the most: the epoch's optimizer
        steps are its share's, counted on every rank alike).

        Example:
            >>> s = BatchShardSampler(range(10), batch_size=2, num_replicas=2, rank=1)
            >>> len(s), s.share(0)
            (4, 6)
        """
        n = len(self.sampler)  # type: ignore[arg-type]
        full, rest = divmod(n, self.batch_size * self.num_replicas)
        if self.drop_last or (self.even_batches and rest):
            return (full + int(not self.drop_last)) * self.batch_size
        return full * self.batch_size + min(max(rest - rank * self.batch_size, 0), self.batch_size)
