"""Checks shared by the trainer integrations: is this an odb loader, and does it fit the trainer?

Each raises with the value, the rule and a fix phrased for the calling framework.

Example:
    >>> import torch, odb
    >>> from odb.integrations.checks import check_accumulation
    >>> loader = odb.ODBDataLoader([{"input_ids": torch.ones(3)}] * 4, token_budget=8)
    >>> check_accumulation(loader, 1, "the Trainer")  # matches: no error
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

from odb.loader.dataloader import ODBLoaderMixin


def check_odb_loader(loader: Any, who: str) -> ODBLoaderMixin:
    """``loader`` itself when it is an odb loader; TypeError otherwise."""
    if not isinstance(loader, ODBLoaderMixin):
        raise TypeError(f"{who} got {type(loader).__name__}, not an odb loader. Fix: pass an odb.ODBDataLoader, "
                        f"or a DataLoader converted with odb.apply(loader, token_budget=...).")
    return loader


def check_accumulation(loader: ODBLoaderMixin, accumulation: int, trainer: str) -> None:
    """The loader must plan the trainer's gradient accumulation (exact scaling normalises over it); with
    ``global_batch_size`` the loader plans each step's micro-batches and the integration follows
    ``is_last_micro_step`` instead (nothing to compare)."""
    if loader.odb_config.global_batch_size is not None:
        return
    planned = loader.odb_config.gradient_accumulation_steps
    if planned != accumulation:
        raise ValueError(
            f"the odb loader plans gradient_accumulation_steps={planned} but {trainer} accumulates "
            f"{accumulation} micro-batches per optimizer step: loss_scale would normalise over the wrong "
            f"micro-batches. Fix: build the loader with gradient_accumulation_steps={accumulation} (or make "
            f"{trainer} accumulate {planned}).")


def check_sharding(loader: ODBLoaderMixin, processes: int, fix: str) -> None:
    """With several processes, a sampler that shards for another number of processes is refused.

    That is the sampler built before torch.distributed was initialised (``ShardSampler()``
    then sees one process). Samplers without ``num_replicas`` pass (a list of this rank's
    indices, a per-rank dataset): odb warns at iteration when it cannot tell. An
    IterableDataset shards itself and is not checked.
    """
    if processes <= 1 or isinstance(loader.dataset, IterableDataset):
        return
    replicas = getattr(loader.sampler, "num_replicas", None)
    if replicas is not None and replicas != processes:
        raise ValueError(
            f"the odb loader's sampler ({type(loader.sampler).__name__}) shards the dataset for "
            f"num_replicas={replicas} processes, but {processes} are training: ranks would train on overlapping "
            f"samples, or miss some. Fix: {fix}")
