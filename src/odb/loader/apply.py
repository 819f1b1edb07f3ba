"""odb.apply: turn a DataLoader that a framework already built into an ODB loader, in place."""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

from torch.utils.data import BatchSampler, DataLoader, default_collate

from odb.comm.protocol import ExchangeFactory
from odb.config import ODBConfig
from odb.loader.core import LoaderCore
from odb.comm.exchanges import exchange_factory
from odb.loader.user_batch import UserBatch
from odb.loader.dataloader import ODBLoaderMixin, check_inputs, draw_seed, group_collate_for, make_config, shuffles
from odb.packed.collate import PackedCollate

_SUBCLASSES: Dict[type, type] = {}


def _odb_class(cls: type) -> type:
    # One subclass per loader type, used only by loaders that odb.apply converted: the
    # framework's own class (and every other loader of it) is never modified.
    sub = _SUBCLASSES.get(cls)
    if sub is None:
        sub = type(f"ODB{cls.__name__}", (ODBLoaderMixin, cls), {"__module__": __name__, "odb_original_class": cls})
        _SUBCLASSES[cls] = sub
    return sub


class ODBHandle:
    """What odb.apply returns: the converted loader and a way to undo the conversion.

    Example:
        >>> import torch, odb
        >>> dl = torch.utils.data.DataLoader([{"input_ids": torch.ones(3)}] * 4, batch_size=1)
        >>> handle = odb.apply(dl, token_budget=8, buffer_size=4)
        >>> handle.loader is dl
        True
        >>> handle.remove(); type(dl).__name__
        'DataLoader'
    """

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader

    @property
    def config(self) -> ODBConfig:
        return self.loader.odb_config

    @property
    def stats(self) -> Dict[str, Any]:
        return self.loader.odb_stats

    def remove(self) -> None:
        """Give the loader back its original class and behaviour."""
        loader = self.loader
        if isinstance(loader, ODBLoaderMixin) and hasattr(type(loader), "odb_original_class"):
            loader.__class__ = type(loader).odb_original_class


def apply(loader: DataLoader, token_budget: Any = None, *, config: Optional[ODBConfig] = None,
          shuffle: Optional[bool] = None, collate_fn: Optional[Callable] = None,
          lengths: Optional[Sequence[int]] = None, process_group: Any = None,
          exchange: Optional[ExchangeFactory] = None, device_mesh: Any = None, peer_group: Any = None,
          **options: Any) -> ODBHandle:
    """Make ``loader`` batch by token budget, in place, keeping its batch as the optimizer step.

    Frameworks that hold a reference to the loader keep it; the loader's dataset,
    sampler, workers, ``drop_last`` and collate_fn are used as they are. The loader's
    ``batch_size`` B (1 for ``batch_size=None``) is your batch: each optimizer step holds the
    ``B x gradient_accumulation_steps x world size`` samples a plain loop over this loader would
    step on (``global_batch_size``), cut into micro-batches under ``token_budget``; step the
    optimizer when ``info.is_last_micro_step``. ``global_batch_size=None`` asks for budget-filled
    steps instead (``gradient_accumulation_steps`` micro-batches filled to the budget). A
    ``batch_sampler`` of the loader's own (not the one ``batch_size`` builds) is refused.
    ``shuffle`` (batch order within windows) defaults to whether the sampler shuffles. With ``batch_size=None``
    the loader's collate_fn is applied per sample in the workers and ``collate_fn``
    (default: default_collate) collates each planned group. With ``layout="packed"``
    and no collate of the user's, groups are collated by ``odb.PackedCollate``.
    ``process_group``, ``peer_group``, ``device_mesh`` and ``exchange`` are as in ``odb.ODBDataLoader``.

    Example:
        >>> import torch, odb
        >>> dl = torch.utils.data.DataLoader([{"input_ids": torch.ones(3)}] * 4, batch_size=1)
        >>> _ = odb.apply(dl, token_budget=8, global_batch_size=None, buffer_size=4)  # budget-filled steps
        >>> [odb.pop_step_info(b).local_samples for b in dl]
        [2, 2]
        >>> dl = torch.utils.data.DataLoader([{"input_ids": torch.ones(3)}] * 4, batch_size=2)
        >>> _ = odb.apply(dl, token_budget=3)      # your batch of 2: one sample per micro-batch fits 3 tokens
        >>> [(i.local_samples, i.is_last_micro_step) for i in map(odb.pop_step_info, dl)]
        [(1, False), (1, True), (1, False), (1, True)]
    """
    if not isinstance(loader, DataLoader):
        raise TypeError(f"odb.apply got {type(loader).__name__}, not a torch DataLoader. "
                        f"Fix: pass the DataLoader itself (or build odb.ODBDataLoader).")
    if isinstance(loader, ODBLoaderMixin):
        raise ValueError("odb.apply got a loader that is already an odb loader. "
                         "Fix: apply once, or call handle.remove() first to reconfigure.")
    if (loader.batch_size is None and loader.batch_sampler is not None) or (
            loader.batch_size is not None and type(loader.batch_sampler) is not BatchSampler):
        raise ValueError(f"odb.apply got a loader with batch_sampler={type(loader.batch_sampler).__name__} "
                         f"(batch_size={loader.batch_size!r}): odb cannot read your batches from a batch sampler of "
                         f"your own, only the sampler and batch size a DataLoader(batch_size=B) is built with. Fix: "
                         f"build the DataLoader with sampler=... and batch_size=B instead of batch_sampler.")
    given = dict(options)
    cfg = make_config(config, token_budget, options, "odb.apply")
    check_inputs(cfg, lengths, getattr(loader, "in_order", True))
    exchanges, cfg = exchange_factory(cfg, process_group, exchange, device_mesh, peer_group)
    where = "the DataLoader's batch_size" if loader.batch_size is not None else "the DataLoader's batch_size=None"
    cfg = UserBatch(loader.batch_size or 1, where, "odb.apply").keep(cfg, given, exchanges)
    if collate_fn is None and cfg.layout == "packed" and (loader.batch_size is None
                                                          or loader.collate_fn is default_collate):
        collate_fn = PackedCollate(ignore_index=cfg.ignore_index,  # one padding-free row per batch
                                       sample_multiple=cfg.length_multiple if cfg.context_parallel > 1 else 1)
    group_collate, transform = group_collate_for(loader, collate_fn)
    seed = cfg.seed if cfg.seed is not None else draw_seed(loader.generator, loader.sampler)
    core = LoaderCore(loader, cfg, shuffle=shuffles(loader) if shuffle is None else bool(shuffle), seed=seed,
                      group_collate=group_collate, sample_transform=transform, own_sampler=None, lengths=lengths,
                      exchanges=exchanges, batch_unit=loader.batch_size or 1)
    loader.__class__ = _odb_class(type(loader))
    loader.odb_attach(core)  # the one attribute odb adds
    return ODBHandle(loader)
