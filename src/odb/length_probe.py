"""Lengths of a map-style dataset read before the epoch: the probe behind ``len(loader)``.

``len()`` of an odb loader is a step estimate (``odb.estimate``) from the samples'
lengths. Without ``lengths=`` (or a ``length`` column), odb reads evenly spaced
samples, as many as their spread asks for (``probe_size``), through the loader's own
sample processing and, where it has any, in its own worker processes.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable, Dict, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from .config import ODBConfig
from .estimate import DEFAULT_PROBE, probe_size
from .sampling import IndexedDataset
from .source import ChunkCollate, SampleMeter


@dataclasses.dataclass(frozen=True)
class Workers:
    """The worker settings of the loader whose samples are measured."""

    num_workers: int = 0
    multiprocessing_context: Any = None
    worker_init_fn: Optional[Callable[[int], None]] = None


def meter_for_workers(meter: SampleMeter, workers: Workers) -> Optional[SampleMeter]:
    """The meter, when workers can run it (it must pickle for spawn/forkserver workers); else None.

    Example:
        >>> from odb.config import ODBConfig
        >>> meter_for_workers(SampleMeter(ODBConfig(token_budget=64)), Workers(num_workers=0)) is None
        True
    """
    if workers.num_workers == 0:
        return None
    ctx = workers.multiprocessing_context
    method = ctx.get_start_method() if ctx is not None else torch.multiprocessing.get_start_method()
    if method == "fork":
        return meter
    try:
        pickle.dumps(meter)
    except Exception:  # e.g. a lambda length_fn: measure in the main process instead
        return None
    return meter


def probe_lengths(dataset: Any, transform: Optional[Callable[[Any], Any]], cfg: ODBConfig, workers: Workers
                  ) -> np.ndarray:
    """Lengths of evenly spaced samples of ``dataset``: DEFAULT_PROBE of them, more while their spread asks for it.

    Example:
        >>> import torch
        >>> from odb.config import ODBConfig
        >>> data = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in range(1, 11)]
        >>> probe_lengths(data, None, ODBConfig(token_budget=64), Workers()).ravel().tolist()
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    """
    total = len(dataset)
    read: Dict[int, tuple] = {}
    want = min(DEFAULT_PROBE, total)
    while True:
        indices = np.unique(np.linspace(0, total - 1, want).astype(np.int64))
        _measure(dataset, transform, cfg, workers, [int(i) for i in indices if int(i) not in read], read)
        lengths = np.array([read[i] for i in sorted(read)], dtype=np.int64)
        need = probe_size(lengths, total, cfg)
        if need <= len(read) or want >= total:
            return lengths
        want = need


def _measure(dataset: Any, transform: Optional[Callable[[Any], Any]], cfg: ODBConfig, workers: Workers,
             indices: Sequence[int], out: Dict[int, tuple]) -> None:
    """Lengths of the given samples into ``out``, measured in worker processes where the loader has any."""
    if not indices:
        return
    meter = SampleMeter(cfg)
    worker_meter = meter_for_workers(meter, workers)
    indexed = IndexedDataset(dataset, transform)
    if worker_meter is None:
        for i in indices:
            out[i] = meter(i, indexed[i][2])[0]
        return
    chunks = [list(indices[k:k + 64]) for k in range(0, len(indices), 64)]
    probe = DataLoader(indexed, batch_sampler=chunks, collate_fn=ChunkCollate(worker_meter, True, False, True),
                       num_workers=workers.num_workers, multiprocessing_context=workers.multiprocessing_context,
                       worker_init_fn=workers.worker_init_fn)
    for _, ids, metas, _, _ in probe:  # (positions, indices, metas, samples, tag) of ChunkCollate
        out.update((i, m[0]) for i, m in zip(ids, metas))
