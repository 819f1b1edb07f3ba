"""Pieces of the inner DataLoader that feeds odb single processed samples.

All public torch.utils.data API: a dataset wrapper that tags each sample with its
position in the epoch's sampler order and its dataset index, a batch sampler that sends
samples to the main process in small chunks (one message per chunk, not per sample),
collates that keep the chunk a list (packing its tensors into one buffer per dtype when
workers send it), a seeded per-epoch shuffle sampler whose order is a pure function of
(seed, epoch), and the stride rule of sharded samplers (rank r of W takes positions
r, r + W, r + 2W, ... of one global order), which elastic resume rebuilds.

A sample's identity within an epoch is its position in the sampler order, not its
dataset index: samplers may repeat indices (replacement, upsampling, padding).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Sized, Tuple

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, IterableDataset, Sampler


class IndexedDataset(Dataset):
    """Map-style wrapper: item ``(position, index)`` is ``(position, index, transform(dataset[index]))``
    (a bare ``index`` is its own position).

    Example:
        >>> IndexedDataset(["a", "b"], str.upper)[(5, 1)]
        (5, 1, 'B')
    """

    def __init__(self, dataset: Any, transform: Optional[Callable[[Any], Any]] = None) -> None:
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Any) -> Tuple[int, int, Any]:
        position, index = key if isinstance(key, tuple) else (key, key)
        sample = self.dataset[index]
        return int(position), int(index), (sample if self.transform is None else self.transform(sample))


class TransformedIterable(IterableDataset):
    """Iterable wrapper applying a per-sample transform in the workers."""

    def __init__(self, dataset: IterableDataset, transform: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.transform = transform

    def __iter__(self) -> Iterator[Any]:
        return (self.transform(s) for s in self.dataset)


class ChunkSampler(Sampler[List[Tuple[int, int]]]):
    """Groups ``(position, index)`` of the sampler's order into chunks (transport only).

    The first chunks of an epoch hold ``size`` samples, so the first window arrives soon;
    later ones grow with the position (an eighth of the samples read so far) up to
    ``max_size``: every message costs the main process a wake-up, an unpickle and a
    shared-memory hand-over, whatever its size. A window still spans several chunks
    (windows grow 1.5x, chunks follow the position).

    ``next_epoch`` sets, for the next iteration only, the positions already consumed (a resumed
    epoch's) and the epoch's order when a resume re-partitioned it across ranks.

    Example:
        >>> list(ChunkSampler([4, 4, 2], size=2))
        [[(0, 4), (1, 4)], [(2, 2)]]
        >>> [len(c) for c in ChunkSampler(range(400), size=16, max_size=64)]
        [16, 16, 16, 16, 16, 16, 16, 16, 16, 18, 20, 22, 25, 28, 32, 36, 40, 35]
    """

    def __init__(self, sampler: Any, size: int, max_size: Optional[int] = None) -> None:
        self.sampler = sampler
        self.size = size
        self.max_size = max(size, max_size or size)
        self.skip = 0  # positions of the next epoch to leave out (used once)
        self.order: Optional[Sequence[int]] = None  # the next epoch's order instead of the sampler's (used once)

    def next_epoch(self, skip: int = 0, order: Optional[Sequence[int]] = None) -> None:
        """The next iteration leaves out the first ``skip`` positions of ``order`` (default: the sampler's)."""
        self.skip, self.order = int(skip), order

    def _size_at(self, position: int) -> int:
        return min(self.max_size, max(self.size, position // 8))

    def __iter__(self) -> Iterator[List[Tuple[int, int]]]:
        chunk: List[Tuple[int, int]] = []
        skip, self.skip = self.skip, 0
        order, self.order = self.order, None
        want = self._size_at(skip)
        for position, index in enumerate(self.sampler if order is None else order):
            if position < skip:
                continue
            chunk.append((position, int(index)))
            if len(chunk) == want:
                yield chunk
                chunk = []
                want = self._size_at(position + 1)
        if chunk:
            yield chunk

    def __len__(self) -> int:
        n, count, position = len(self.sampler), 0, 0
        while position < n:
            position += self._size_at(position)
            count += 1
        return count


class EpochShuffleSampler(Sampler[int]):
    """A random permutation of ``range(len(data_source))`` fixed by (seed, epoch).

    Example:
        >>> s = EpochShuffleSampler(range(5), seed=1)
        >>> s.set_epoch(3)
        >>> sorted(s) == list(range(5))
        True
    """

    def __init__(self, data_source: Sized, seed: int) -> None:
        self.data_source = data_source
        self.seed = int(seed)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.data_source)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed((self.seed * 1_000_003 + self.epoch) % (2**63))
        return iter(torch.randperm(len(self.data_source), generator=g).tolist())


class ShardSampler(Sampler[int]):
    """Each rank's share of a (shuffled) dataset, without DistributedSampler's padding.

    DistributedSampler repeats indices so that every rank has the same count; odb's
    join mode does not need equal counts, so this sampler gives every index to exactly
    one rank (ranks differ by at most one sample).

    Example:
        >>> parts = [list(ShardSampler(range(5), num_replicas=2, rank=r, shuffle=False)) for r in (0, 1)]
        >>> parts
        [[0, 2, 4], [1, 3]]
    """

    def __init__(self, data_source: Sized, num_replicas: Optional[int] = None, rank: Optional[int] = None,
                 shuffle: bool = True, seed: int = 0) -> None:
        if num_replicas is None or rank is None:
            from odb.comm.dist import world  # the one module that reads torch.distributed

            default_rank, default_world = world()
            num_replicas = default_world if num_replicas is None else num_replicas
            rank = default_rank if rank is None else rank
        if not 0 <= rank < num_replicas:
            raise ValueError(f"ShardSampler got rank={rank} with num_replicas={num_replicas}: the rank must be in "
                             f"[0, num_replicas). Fix: pass the process's rank and the world size.")
        self.data_source, self.num_replicas, self.rank = data_source, num_replicas, rank
        self.shuffle, self.seed, self.epoch = shuffle, int(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        n = len(self.data_source)
        return n // self.num_replicas + (1 if self.rank < n % self.num_replicas else 0)

    def __iter__(self) -> Iterator[int]:
        n = len(self.data_source)
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed((self.seed * 1_000_003 + self.epoch) % (2**63))
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        return iter(order[self.rank::self.num_replicas])


def stride_sharded(sampler: Any) -> bool:
    """Whether ``sampler`` gives rank r of W the positions r, r + W, ... of one global order that
    depends only on (its settings, epoch, W): odb.ShardSampler and DistributedSampler."""
    return isinstance(sampler, (ShardSampler, DistributedSampler))


def sampler_settings(sampler: Any) -> Optional[Dict[str, Any]]:
    """What fixes a stride-sharded sampler's global order (plain data, for resume states)."""
    if not stride_sharded(sampler):
        return None
    return {"kind": type(sampler).__name__, "seed": int(sampler.seed), "shuffle": bool(sampler.shuffle),
            "drop_last": bool(getattr(sampler, "drop_last", False))}


def global_order(sampler: Any, world: int, epoch: int) -> np.ndarray:
    """The global order (dataset indices) that ``world`` ranks of ``sampler``'s kind and settings
    shard by the stride rule at ``epoch``: rank r's order is ``global_order(...)[r::world]``.

    Rebuilt from one sampler per rank, through their public constructors only.

    Example:
        >>> s = ShardSampler(range(5), num_replicas=3, rank=0, shuffle=False)
        >>> global_order(s, 2, epoch=0).tolist()
        [0, 1, 2, 3, 4]
    """
    data = sampler.data_source if isinstance(sampler, ShardSampler) else sampler.dataset
    orders = []
    for rank in range(world):
        if isinstance(sampler, ShardSampler):
            part: Any = ShardSampler(data, num_replicas=world, rank=rank, shuffle=sampler.shuffle, seed=sampler.seed)
        else:
            part = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=sampler.shuffle,
                                      seed=sampler.seed, drop_last=sampler.drop_last)
        part.set_epoch(epoch)
        orders.append(np.fromiter(part, dtype=np.int64))
    out = np.empty(sum(len(o) for o in orders), dtype=np.int64)
    for rank, order in enumerate(orders):
        if len(out[rank::world]) != len(order):
            raise RuntimeError(f"{type(sampler).__name__} does not follow the stride rule at world size {world}: "
                               f"rank {rank} has {len(order)} indices, not {len(out[rank::world])}.")
        out[rank::world] = order
    return out


class _TensorSlot:
    """Placeholder for the k-th tensor of a packed chunk."""

    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k

    def __reduce__(self) -> Tuple[Any, Tuple[int]]:
        return _TensorSlot, (self.k,)


def _packable(obj: Any) -> bool:
    return (type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu"
            and not obj.requires_grad and not obj.is_quantized)


Packed = Tuple[Any, Dict[torch.dtype, torch.Tensor], List[Tuple[torch.dtype, int, Tuple[int, ...]]]]


def pack_chunk(samples: List[Any]) -> Packed:
    """Collate of the inner loader with workers: the chunk's tensors travel as one buffer per dtype.

    A worker hands each tensor to the main process through its own shared-memory file
    descriptor, which costs about a millisecond per tensor; one buffer per chunk pays
    that once. Tensors inside plain dicts, lists and tuples are packed; anything else
    travels as before.
    """
    tensors: List[torch.Tensor] = []

    def strip(obj: Any) -> Any:
        if _packable(obj):
            tensors.append(obj)
            return _TensorSlot(len(tensors) - 1)
        if type(obj) is dict:
            return {k: strip(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(strip(v) for v in obj)
        return obj

    skeleton = strip(samples)
    parts: Dict[torch.dtype, List[torch.Tensor]] = {}
    used: Dict[torch.dtype, int] = {}
    specs = []
    for t in tensors:
        specs.append((t.dtype, used.get(t.dtype, 0), tuple(t.shape)))
        used[t.dtype] = used.get(t.dtype, 0) + t.numel()
        parts.setdefault(t.dtype, []).append(t.reshape(-1))
    return skeleton, {d: torch.cat(p) for d, p in parts.items()}, specs


def unpack_chunk(packed: Packed) -> List[Any]:
    """The samples of a packed chunk; their tensors are views into the chunk's buffers."""
    skeleton, buffers, specs = packed

    def fill(obj: Any) -> Any:
        if type(obj) is _TensorSlot:
            dtype, offset, shape = specs[obj.k]
            return buffers[dtype][offset:offset + math.prod(shape)].view(shape)
        if type(obj) is dict:
            return {k: fill(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(fill(v) for v in obj)
        return obj

    return fill(skeleton)
