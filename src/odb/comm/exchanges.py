"""Where odb's exchanges come from: torch.distributed's ranks, a group of them, a device mesh, or a factory.

``choose_exchanges`` is the one choice, which the loader and an RL trainer's rollout rows
(odb.integrations.trl.rl_steps) both make; ``exchange_factory`` reads the loader's ``process_group``, ``peer_group``, ``device_mesh`` and ``exchange``
arguments. Without any, the exchanges span every rank of torch.distributed and each rank is a data-parallel
replica. Under tensor, context, sequence or pipeline parallelism each replica spans several ranks, its peers:
``device_mesh=`` (a torch DeviceMesh whose data-parallel dimensions are named "dp", or "dp_replicate" and
"dp_shard"), or ``process_group=`` (the data-parallel group) with ``peer_group=`` (the replica's other ranks).
odb then plans over the replicas, and every peer of a replica gets the same batches (odb.comm.replicas says
how). A mesh's "cp" dimension sets ``context_parallel``.

Example:
    >>> from odb.config import ODBConfig
    >>> factory, cfg = exchange_factory(ODBConfig(token_budget=64))
    >>> factory.world(), cfg.context_parallel
    ((0, 1), 1)
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

from odb.comm.dist import GroupExchanges, mesh_exchanges, peer_exchanges
from odb.comm.protocol import ExchangeFactory
from odb.config import ODBConfig


def exchange_factory(cfg: ODBConfig, process_group: Any = None, exchange: Optional[ExchangeFactory] = None,
                     device_mesh: Any = None, peer_group: Any = None
                     ) -> Tuple[Optional[ExchangeFactory], ODBConfig]:
    """(where the loader's exchanges come from, its options) for the loader's arguments: ``exchange`` (a factory:
    ``world()``, ``processes()`` and ``factory(timeout_s) -> RankExchange``), else torch.distributed (``device_mesh``,
    ``process_group`` with or without ``peer_group``, or every rank); None for a local loader
    (``distributed=False``). A mesh's context parallel degree becomes ``context_parallel``."""
    given = {name: value for name, value in (("process_group", process_group), ("exchange", exchange),
                                             ("device_mesh", device_mesh), ("peer_group", peer_group))
             if value is not None}
    if len(set(given) - {"peer_group"}) > 1 or ("peer_group" in given and "process_group" not in given):
        raise ValueError(f"odb got {', '.join(f'{k}={v!r}' for k, v in given.items())}: each says how the ranks "
                         f"exchange. Rule: one of device_mesh=, process_group= (with peer_group= for the peers of "
                         f"a replica) or exchange=. Fix: pass one (device_mesh= for tensor, context or sequence "
                         f"parallelism; exchange= is for tests and custom transports, e.g. "
                         f"odb.comm.threads.ThreadRanks(n).exchanges(rank)).")
    for name, value in given.items():
        if not cfg.distributed:
            raise ValueError(f"odb got {name}={value!r} with distributed=False: a local loader "
                             f"exchanges nothing. Fix: drop {name}, or drop distributed=False.")
    if not cfg.distributed:
        return None, cfg
    factory, cp = choose_exchanges(process_group, exchange, device_mesh, peer_group)
    if device_mesh is not None:
        return factory, with_context_parallel(cfg, cp, "the device mesh's 'cp' dimension")
    return factory, cfg


def choose_exchanges(process_group: Any = None, exchange: Optional[ExchangeFactory] = None, device_mesh: Any = None,
                     peer_group: Any = None) -> Tuple[ExchangeFactory, int]:
    """The one choice of where odb's exchanges run, for the loader and for an RL trainer's rows alike: (the
    factory, the context parallel degree a device mesh names, else 1). ``exchange`` as given; a ``device_mesh``'s
    replicas; ``process_group`` with ``peer_group``; else a gloo group over ``process_group``'s ranks (None: every
    rank of torch.distributed).

    Example:
        >>> factory, cp = choose_exchanges()
        >>> factory.world(), cp
        ((0, 1), 1)
    """
    if exchange is not None:
        return exchange, 1
    if device_mesh is not None:
        return mesh_exchanges(device_mesh)
    if peer_group is not None:
        return peer_exchanges(process_group, peer_group), 1
    return GroupExchanges(process_group), 1


def with_context_parallel(cfg: ODBConfig, cp: int, source: str) -> ODBConfig:
    """``cfg`` with ``context_parallel=cp`` (read from ``source``); refuses another value the user set."""
    if cp == cfg.context_parallel:
        return cfg
    if cfg.context_parallel != 1:
        raise ValueError(f"odb got context_parallel={cfg.context_parallel} but {source} has size {cp}. Rule: a "
                         f"micro-batch costs T / cp on each context-parallel rank, so odb must know the cp the model "
                         f"runs with. Fix: drop context_parallel (the mesh sets it) or make them equal.")
    return cfg.replace(context_parallel=cp)
