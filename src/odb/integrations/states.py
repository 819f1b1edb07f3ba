"""Every rank's odb resume state in one list, for trainers whose checkpoints rank 0 alone writes.

Accelerate (``register_for_checkpointing``) and Lightning (loader states in the fit
loop) save an object's state from the main process only, while each rank's odb loader
has its own. ``gather_states`` collects them through odb's metadata exchange (the states
are plain data and travel as JSON: nothing is unpickled); ``restore_rank_state`` gives a
rank its own entry, or, on another number of processes, the whole list to re-partition
the interrupted epoch (elastic resume, docs/resume.md).

Example:
    >>> import torch, odb
    >>> loader = odb.ODBDataLoader([{"input_ids": torch.ones(3)}] * 4, token_budget=8, buffer_size=4)
    >>> states = gather_states(loader.state_dict(), loader)   # one process: a list of one
    >>> restore_rank_state(loader, states, "example")
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from odb.comm.dist import world
from odb.comm.protocol import RankExchange
from odb.loader.dataloader import ODBLoaderMixin


# The last gather's factory and exchange: the next gather through the same factory reuses the exchange while it is
# alive, another one releases it (and exit releases the last).
_previous: Optional[Tuple[Any, RankExchange]] = None


def gather_states(state: Dict[str, Any], loader: ODBLoaderMixin) -> List[Dict[str, Any]]:
    """Every rank's ``state`` in rank order (call on all ranks at once: two small all_gathers). Under a mesh a rank
    is a data-parallel replica: one state per replica (its first peer's; its peers hold the same plan)."""
    global _previous
    factory = loader.odb_core.exchange_factory
    if factory is None or factory.processes() == 1:
        return [state]
    raw = json.dumps(state).encode()
    if _previous is not None and _previous[0] is factory and not _previous[1].dead:
        exchange = _previous[1]  # one group for a run's checkpoints: none made or torn down at each save
    else:
        exchange = factory(loader.odb_config.exchange_timeout_s)  # new_group: every rank is past the last gather
        if _previous is not None:
            _previous[1].release()
        _previous = (factory, exchange)
    sizes = exchange.all_gather(np.array([len(raw)]), "checkpoint (state sizes)", every_process=True)[:, 0]
    local = np.zeros(-(-int(sizes.max()) // 8), dtype=np.int64)
    local.view(np.uint8)[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    rows = exchange.all_gather(local, "checkpoint (states)", every_process=True)
    kept = exchange.replicas.leaders.tolist() if exchange.replicas is not None else range(len(rows))
    return [json.loads(rows[r].tobytes()[:int(sizes[r])]) for r in kept]


def restore_rank_state(loader: ODBLoaderMixin, states: Any, who: str) -> None:
    """Load this rank's entry of ``gather_states`` into ``loader``, and set its sampler's epoch.

    When ``states`` were saved by another number of processes (elastic resume), the whole
    list goes to ``loader.load_state_dict``, which re-partitions the interrupted epoch over
    this run's ranks (map-style data, ``odb.ShardSampler`` or ``DistributedSampler``).
    """
    rank, size = loader.odb_core.world()
    if not isinstance(states, list) or not states:
        raise ValueError(f"{who} got {type(states).__name__} where it expects the list of every saved rank's odb "
                         f"state (as state_dict() writes it under 'odb_rank_states'): the checkpoint was not "
                         f"saved by this integration. Fix: resume from a checkpoint it saved, or restart the "
                         f"epoch without the checkpoint's loader state.")
    if len(states) == size:
        loader.load_state_dict(states[rank])
        # odb restores its own epoch; a sampler of the user's (ShardSampler, DistributedSampler) learns it here, or
        # a fresh loader would skip the consumed prefix of epoch 0's order instead of the saved epoch's
        loader.set_epoch(int(states[rank]["epoch"]))
        return
    try:  # this rank's share of what no saved rank emitted; load_state_dict sets the sampler's epoch
        loader.load_state_dict(states)
    except ValueError as err:
        raise ValueError(f"{who} got {len(states)} saved rank states for {size} processes and cannot re-partition "
                         f"them: {err}") from err


def saved_elsewhere(states: List[Dict[str, Any]]) -> bool:
    """Whether ``states`` (every saved rank's) come from another number of processes than this run's."""
    return len(states) != world()[1]
