"""Lengths of a map-style dataset read before the epoch: the probe behind ``len(loader)``.

``len()`` of an odb loader is a step estimate (``odb.plan.windows.estimate``) from the samples'
lengths. Without ``lengths=`` (or a ``length`` column), odb reads evenly spaced
samples, as many as their spread asks for (``probe_size``), through the loader's own
sample processing and, where it has any, in its own worker processes. A length seen
there that alone exceeds the budget (``first_oversize``) is refused by ``len()`` with
``oversize="error"``, as the epoch would refuse it.
"""

from __future__ import annotations

import dataclasses
import pickle
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader

from odb.plan.costs.buckets import oversize_message
from odb.config import ODBConfig
from odb.plan.costs.cost import CostModel
from odb.plan.windows.estimate import DEFAULT_PROBE, probe_size
from odb.data.sampling import IndexedDataset
from odb.data.source import ChunkCollate, SampleMeter


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


def first_oversize(lengths: Any, cfg: ODBConfig) -> Optional[Tuple[int, Tuple[int, ...], int]]:
    """``(position, its lengths, the budget it needs)`` of the first sample that alone costs more than
    ``cfg.token_budget`` (the smallest int budget that fits it), or None when every sample fits.

    Example:
        >>> from odb.config import ODBConfig
        >>> first_oversize([3, 9, 12], ODBConfig(token_budget=8, pad_to_multiple_of=4))
        (1, (9,), 12)
        >>> first_oversize([3, 7], ODBConfig(token_budget=8)) is None
        True
    """
    values = np.asarray(lengths, dtype=np.int64)
    if values.size == 0:
        return None
    values = values.reshape(len(values), -1)
    if len(cfg.token_budgets) > 1 and values.shape[1] != len(cfg.token_budgets):
        return None  # lengths of another shape than the budget: the planner names that mismatch
    cost = CostModel.from_config(cfg)
    padded = cost.pad(values)
    over = np.flatnonzero(cost.copies_that_fit_unrounded(padded) < 1)
    if not len(over):
        return None
    k = int(over[0])
    weight = cost.token_weight(padded[k:k + 1])[0]
    return k, tuple(int(v) for v in values[k]), int(np.ceil(weight.max() if len(cfg.token_budgets) > 1
                                                             else weight.sum()))


def check_probed_fit(lengths: Any, cfg: ODBConfig, what: str, total: Optional[int] = None) -> None:
    """Refuse (``oversize="error"``) lengths of which one alone exceeds the budget; ``what`` says where
    they come from. ``total``: the dataset's size (when ``lengths`` has one entry per index, the
    message names the sample's index).

    Example:
        >>> from odb.config import ODBConfig
        >>> check_probed_fit([3, 40], ODBConfig(token_budget=32), "len(loader) measured them", total=2)
        Traceback (most recent call last):
        ...
        ValueError: sample 1 has length 40, so alone it exceeds token_budget=32 (found when len(loader) ...
    """
    found = first_oversize(lengths, cfg) if cfg.oversize == "error" else None
    if found is None:
        return
    k, length, needed = found
    shown = length[0] if len(length) == 1 else length
    who = f"sample {k}" if total is not None and len(lengths) == total else "a sample"
    if cfg.shape_buckets is not None:
        raise ValueError(oversize_message(who, shown, max(length), cfg.shape_buckets, cfg.token_budget,
                                          f" (found when {what})"))
    raise ValueError(f"{who} has length {shown}, so alone it exceeds token_budget={cfg.token_budget} "
                     f"(found when {what}). Rule: oversize='error' refuses such samples, and the epoch would stop "
                     f"at it. Fix: raise token_budget (to at least {needed} for this sample), truncate samples "
                     f"(e.g. tokenizer max_length), or pass oversize='alone' (own batch) or 'skip'.")
