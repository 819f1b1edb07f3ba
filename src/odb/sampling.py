"""Pieces of the inner DataLoader that feeds odb single processed samples.

All public torch.utils.data API: a dataset wrapper that tags each sample with its
index, a batch sampler that sends samples to the main process in small chunks (one
message per chunk, not per sample), collates that keep the chunk a list (packing its
tensors into one buffer per dtype when workers send it), and a
seeded per-epoch shuffle sampler whose order is a pure function of (seed, epoch).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Iterator, List, Optional, Sized, Tuple

import torch
from torch.utils.data import Dataset, IterableDataset, Sampler


class IndexedDataset(Dataset):
    """Map-style wrapper: item i is ``(i, transform(dataset[i]))``."""

    def __init__(self, dataset: Any, transform: Optional[Callable[[Any], Any]] = None) -> None:
        self.dataset = dataset
        self.transform = transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Tuple[int, Any]:
        sample = self.dataset[index]
        return int(index), (sample if self.transform is None else self.transform(sample))


class TransformedIterable(IterableDataset):
    """Iterable wrapper applying a per-sample transform in the workers."""

    def __init__(self, dataset: IterableDataset, transform: Callable[[Any], Any]) -> None:
        self.dataset = dataset
        self.transform = transform

    def __iter__(self) -> Iterator[Any]:
        return (self.transform(s) for s in self.dataset)


class ChunkSampler(Sampler[List[int]]):
    """Groups the indices of ``sampler`` into chunks of ``size`` (transport only)."""

    def __init__(self, sampler: Any, size: int) -> None:
        self.sampler = sampler
        self.size = size
        self.skip = 0  # indices of the next epoch to leave out (set by a resume, used once)

    def __iter__(self) -> Iterator[List[int]]:
        chunk: List[int] = []
        skip, self.skip = self.skip, 0
        for position, index in enumerate(self.sampler):
            if position < skip:
                continue
            chunk.append(index)
            if len(chunk) == self.size:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.size)


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
            from .dist import world  # the one module that reads torch.distributed

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
