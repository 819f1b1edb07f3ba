"""ODBDataLoader: a torch DataLoader whose batches are planned under a token budget."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Union

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from odb.arguments import check_in_order, check_options
from odb.comm.protocol import ExchangeFactory
from odb.config import CONFIG_FIELDS, ODBConfig
from odb.data.lengths import check_length_dims
from odb.data.sampling import EpochShuffleSampler
from odb.loader.user_batch import UserBatch
from odb.loader.core import LoaderCore
from odb.comm.exchanges import exchange_factory
from odb.loader.sources import shuffles
from odb.packed.collate import PackedCollate

# The other arguments of ODBDataLoader (suggested for misspelt options).
_LOADER_ARGS = tuple(inspect.signature(DataLoader.__init__).parameters)[1:] + ("config", "lengths",
                                                                            "process_group", "exchange",
                                                                            "device_mesh", "peer_group")


def make_config(config: Optional[ODBConfig], token_budget: Any, options: Dict[str, Any], who: str = "odb",
                also: Sequence[str] = (), rule: str = "odb options are odb.ODBConfig fields") -> ODBConfig:
    """One ODBConfig from a config object and/or keyword options. ``who`` names the caller in errors; a
    misspelt option gets the closest ODBConfig field (or name in ``also``), a batch size odb's rule."""
    check_options(options, who, CONFIG_FIELDS | set(also), rule)
    if config is not None:
        if token_budget is not None:
            options["token_budget"] = token_budget
        return config.replace(**options) if options else config
    if token_budget is None:
        raise TypeError("odb needs token_budget (the most padded tokens per batch, B x L). "
                        "Fix: pass token_budget=16384 or config=ODBConfig(...).")
    return ODBConfig(token_budget=token_budget, **options)


def check_inputs(cfg: ODBConfig, lengths: Optional[Sequence[int]], in_order: Any) -> None:
    """What ODBDataLoader and odb.apply refuse before they change anything: ``in_order=False``, and
    per-dimension budgets that nothing measures."""
    check_in_order(in_order)
    check_length_dims(cfg.token_budgets, cfg.length_fn, lengths)


def draw_seed(generator: Optional[torch.Generator], sampler: Any = None) -> int:
    """A base seed: from the DataLoader's generator when given, else the sampler's own seed (a
    DistributedSampler's or odb.ShardSampler's: its shuffle and odb's batch order then repeat
    together), else torch's global RNG."""
    if generator is not None:
        return int(generator.initial_seed()) % (2**62)
    own = getattr(sampler, "seed", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own % (2**62)
    return int(torch.empty((), dtype=torch.int64).random_().item()) % (2**62)


class ODBLoaderMixin(DataLoader):
    """The odb behaviour shared by ODBDataLoader and loaders converted by odb.apply.

    It subclasses DataLoader (and is never built directly) so that a loader's class can
    be switched in place: Python allows that only between classes of the same layout.
    Every method delegates to the loader's ``LoaderCore`` (``odb_core``), its one odb attribute.
    """
    _odb: LoaderCore

    def odb_attach(self, core: LoaderCore) -> None:
        """Make ``core`` (built for this loader) do this loader's odb work: ODBDataLoader and
        ``odb.apply`` call it once; not for user code."""
        self._odb = core

    # ---- public ----------------------------------------------------------------------
    @property
    def odb_core(self) -> LoaderCore:
        """The object that does this loader's odb work (odb.loader.core.LoaderCore): for integrations and
        tests that need its parts (e.g. ``odb_core.inner_loader``, ``odb_core.world()``). Its attributes are
        not a stable API; the loader's own methods are."""
        return self._odb

    @property
    def odb_config(self) -> ODBConfig:
        """The options this loader plans with (as given: token_budget="auto" stays "auto"; its current
        budget is in ``odb_stats["auto_window_budget"]``)."""
        return self._odb.cfg

    @property
    def odb_stats(self) -> Dict[str, Any]:
        """Counters of the current (or last) epoch on this rank, up to the last batch the training loop
        received (plus OOM counters, since the loader was built)."""
        return self._odb.stats()

    @property
    def odb_oom_counters(self) -> Any:
        """Pass as ``odb.train.oom.train_step_with_oom_fallback(..., counters=loader.odb_oom_counters)``: the
        OOM counts then appear in ``odb_stats``."""
        return self._odb.oom_counters()

    def odb_abort(self, reason: "BaseException | str") -> None:
        """Stop this epoch because of ``reason`` (an exception or a message) found on the training thread,
        and tell the other ranks: they raise ``odb.comm.protocol.ODBRankFailed`` naming this rank and the reason at
        their next exchange, instead of waiting for this rank. Then raise your error as usual.

        odb's integrations call it for their own checks; call it yourself when you catch an error of
        the training loop and keep the process alive (a notebook, a handler that saves a checkpoint).

        Example:
            >>> import torch, odb
            >>> loader = odb.ODBDataLoader([{"input_ids": torch.ones(4)}] * 4, token_budget=8, collate_fn=list)
            >>> it = iter(loader); batch = next(it)
            >>> loader.odb_abort(ValueError("bad labels"))   # on one process: just stops the epoch
            >>> next(it)
            Traceback (most recent call last):
            ...
            ValueError: bad labels
        """
        self._odb.abort(reason)

    def set_token_budget(self, token_budget: Any) -> None:
        """Use ``token_budget`` from the next planning window on (replaces any budget_schedule).

        The loader plans up to a window ahead of the training loop, so the new budget reaches
        batches once the windows already planned are used up. Under DDP call it on every rank
        at the same step. To resume after a change, call it again on the fresh loader before
        ``load_state_dict``.
        """
        self._odb.set_token_budget(token_budget)

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration (and of the sampler, when it has set_epoch)."""
        self._odb.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        return _held(self, self._odb.iterate())  # the epoch starts now (workers, the ranks' group)

    def __len__(self) -> int:
        """Batches (micro-batches) per epoch: exact after a full epoch, else an estimate from sample lengths."""
        return len(self._odb)

    @property
    def odb_optimizer_steps(self) -> Optional[int]:
        """Optimizer steps per epoch with ``global_batch_size``, exact: ceil(samples / global_batch_size)
        (with ``drop_last``, of the whole batches of ``batch_size`` each rank keeps; floor without a
        ``batch_size``); None with budget-filled steps or a sampler without a length. With
        ``global_batch_size`` the micro-batches of a step vary, so ``len(loader)`` (batches) is an estimate
        until an epoch has run, and this is the count a learning-rate schedule needs.

        Example:
            >>> import torch, odb
            >>> data = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (5, 3, 8, 2, 4)]
            >>> odb.ODBDataLoader(data, token_budget=8, global_batch_size=2, collate_fn=list).odb_optimizer_steps
            3
        """
        return self._odb.optimizer_steps()

    def state_dict(self) -> Dict[str, Any]:
        """Where this loader is, as plain data: ``load_state_dict`` on a fresh loader built with the
        same arguments continues with exactly the batches this one has not emitted yet.

        Call it between batches (e.g. when the trainer checkpoints; it costs well under a
        millisecond, so every step is fine). Each rank saves its own. The dict holds only ints,
        floats, bools, strings, lists and dicts: save it with ``json.dump`` or ``torch.save``
        (it loads with ``torch.load(..., weights_only=True)``).

        Example:
            >>> import json, torch, odb
            >>> data = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (5, 3, 8, 2)]
            >>> loader = odb.ODBDataLoader(data, token_budget=16, buffer_size=4, collate_fn=list)
            >>> first = next(iter(loader))
            >>> fresh = odb.ODBDataLoader(data, token_budget=16, buffer_size=4, collate_fn=list)
            >>> fresh.load_state_dict(json.loads(json.dumps(loader.state_dict())))
            >>> [odb.pop_step_info(b).sample_ids for b in fresh]
            [(1, 3)]
        """
        return self._odb.state_dict()

    def load_state_dict(self, state: Union[Dict[str, Any], Sequence[Dict[str, Any]]]) -> None:
        """Continue from ``state_dict()`` at the next ``iter()``.

        ``state`` is this rank's own state (same world size), or the list of every rank's
        states: with another world size the interrupted epoch is re-partitioned over this
        one's ranks (map-style data, ``odb.ShardSampler`` or ``DistributedSampler``; see
        docs/resume.md). Strict: refuses another dataset, sampler or planning options, with
        the reason and the fix.
        """
        self._odb.load_state_dict(state)


class ODBDataLoader(ODBLoaderMixin):
    """A DataLoader whose batches hold as many samples as fit ``token_budget``.

    Every DataLoader argument keeps its meaning. ``batch_size=B`` is your batch, as in a plain
    DataLoader: each optimizer step holds the ``B x gradient_accumulation_steps x world size``
    samples a plain loop would step on (``global_batch_size``), and odb cuts them into micro-batches
    under ``token_budget``; step the optimizer when ``info.is_last_micro_step``. Leaving
    ``batch_size`` out (None) keeps budget-filled steps (``gradient_accumulation_steps`` micro-batches
    filled to the budget: other updates than a fixed batch gives), or the ``global_batch_size`` you
    pass. ``shuffle=True`` shuffles the samples (seeded, per
    epoch) and the batch order within each window; with a ``sampler`` (which, as in
    torch, excludes ``shuffle=True``) the batch order is shuffled when the sampler
    shuffles. ``in_order=False`` is refused (odb reads samples in sampler order). ODB
    options are ODBConfig fields, given as keyword arguments or as ``config=``. Each
    batch carries an ``ODBStepInfo`` (see ``odb.pop_step_info``).

    Under torch.distributed the ranks exchange a few integers per window and step on gloo
    groups of their own, over every rank (``process_group``: over that group's ranks). Under
    tensor, context, sequence or pipeline parallelism pass ``device_mesh`` (a DeviceMesh with a
    data-parallel dimension named "dp", or "dp_replicate" and "dp_shard"), or ``process_group``
    (the data-parallel group) with ``peer_group`` (the other ranks of the replica): odb plans over
    the replicas and every peer of one gets the same batches (docs/distributed.md, "Meshes").
    ``exchange``, for tests and custom transports, replaces torch.distributed with an exchange
    factory, e.g. ``odb.comm.threads.ThreadRanks(2).exchanges(rank)`` for ranks that are threads.

    Example:
        >>> import torch, odb
        >>> data = [{"input_ids": torch.ones(n, dtype=torch.long)} for n in (5, 3, 8, 2)]
        >>> loader = odb.ODBDataLoader(data, token_budget=16, buffer_size=4, collate_fn=list)
        >>> sorted(len(odb.pop_step_info(b).sample_ids) for b in loader)
        [2, 2]
        >>> loader = odb.ODBDataLoader(data, token_budget=16, batch_size=4, collate_fn=list,  # your batch of 4
        ...                            micro_batch_cost=4)  # what a micro-batch costs beyond its tokens
        >>> [(i.local_samples, i.is_last_micro_step) for i in map(odb.pop_step_info, loader)]
        [(2, False), (2, True)]
    """

    def __init__(self, dataset: Any, token_budget: Any = None, *, config: Optional[ODBConfig] = None,
                 batch_size: Optional[int] = None, shuffle: Optional[bool] = None, sampler: Any = None,
                 batch_sampler: Any = None, num_workers: int = 0, collate_fn: Optional[Callable] = None,
                 pin_memory: bool = False, drop_last: bool = False, timeout: float = 0,
                 worker_init_fn: Optional[Callable] = None, multiprocessing_context: Any = None,
                 generator: Optional[torch.Generator] = None, prefetch_factor: Optional[int] = None,
                 persistent_workers: bool = False, pin_memory_device: str = "",
                 lengths: Optional[Sequence[int]] = None, process_group: Any = None,
                 exchange: Optional[ExchangeFactory] = None, device_mesh: Any = None, peer_group: Any = None,
                 **options: Any) -> None:
        dl_options = {k: options.pop(k) for k in list(options) if k == "in_order"}
        given = dict(options)
        cfg = make_config(config, token_budget, options, "ODBDataLoader", _LOADER_ARGS,
                          "ODBDataLoader takes odb.ODBConfig fields and DataLoader arguments")
        check_inputs(cfg, lengths, dl_options.get("in_order", True))
        if batch_sampler is not None:
            raise ValueError(f"ODBDataLoader got batch_sampler={batch_sampler!r}: odb cuts each optimizer step into "
                             f"micro-batches under token_budget itself. Fix: drop batch_sampler and pass its sampler "
                             f"and batch size (sampler=..., batch_size=B).")
        exchanges, cfg = exchange_factory(cfg, process_group, exchange, device_mesh, peer_group)
        if batch_size is not None:  # the user's batch: B x accumulation x world samples per optimizer step
            cfg = UserBatch(batch_size, "ODBDataLoader(batch_size=...)", "ODBDataLoader").keep(cfg, given, exchanges)
        iterable = isinstance(dataset, IterableDataset)
        if iterable and sampler is not None:
            raise ValueError(f"ODBDataLoader got sampler={sampler!r} with an IterableDataset, which has no indices. "
                             f"Fix: drop sampler; shard and order inside the dataset.")
        if shuffle and sampler is not None:
            raise ValueError(f"ODBDataLoader got shuffle=True with sampler={type(sampler).__name__}: the sampler "
                             f"decides the order (torch's DataLoader refuses this too). Fix: drop shuffle (odb "
                             f"shuffles its batch order when the sampler shuffles, e.g. DistributedSampler or "
                             f"odb.ShardSampler with shuffle=True), or drop sampler.")
        seed = cfg.seed if cfg.seed is not None else draw_seed(generator, sampler)
        if collate_fn is None and cfg.layout == "packed":
            collate_fn = PackedCollate(ignore_index=cfg.ignore_index,  # one padding-free row per batch
                                       sample_multiple=cfg.length_multiple if cfg.context_parallel > 1 else 1)
        own = None
        if shuffle and sampler is None and not iterable:
            own = sampler = EpochShuffleSampler(dataset, seed)
        super().__init__(dataset, batch_size=1, shuffle=None, sampler=sampler, num_workers=num_workers,
                         collate_fn=collate_fn, pin_memory=pin_memory, drop_last=drop_last, timeout=timeout,
                         worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                         generator=generator, prefetch_factor=prefetch_factor,
                         persistent_workers=persistent_workers, pin_memory_device=pin_memory_device, **dl_options)
        batch_order = shuffles(self) if shuffle is None else bool(shuffle)  # with a sampler: as it does
        self.odb_attach(LoaderCore(self, cfg, shuffle=batch_order, seed=seed, group_collate=self.collate_fn,
                                   sample_transform=None, own_sampler=own, lengths=lengths, exchanges=exchanges,
                                   batch_unit=batch_size))


def _held(loader: Any, batches: Iterator[Any]) -> Iterator[Any]:
    """``batches``, holding ``loader``: an iteration keeps its loader alive (``for b in ODBDataLoader(...)``),
    and a loader that is gone lets go of its epoch and workers (odb.loader.core.LoaderCore.release)."""
    yield from batches


def group_collate_for(loader: DataLoader, collate_fn: Optional[Callable]) -> tuple:
    """(group collate, per-sample transform) for a loader: its collate_fn collates a batch (batch_size B), or
    runs per sample (batch_size=None)."""
    if loader.batch_size is not None:
        return (collate_fn or loader.collate_fn), None
    return (collate_fn or default_collate), loader.collate_fn
