"""The loader's resume state: what ``state_dict()`` saves and how ``load_state_dict()`` takes it back.

Plain functions over explicit values (the loader's core, odb.loader.core.LoaderCore,
calls them with its own): ``saved_state`` assembles the state, ``state_to_resume`` checks
a saved one (or every rank's, re-partitioned on another world size), ``resume_order`` and
``retained_samples`` give a resumed epoch its order and the samples it needs again. See
odb.resume.state for the epoch's own state.
"""

from __future__ import annotations

import itertools
import json
from typing import Any, Dict, List, Optional, Sequence, Union

import numpy as np
from torch.utils.data import DistributedSampler, SequentialSampler

from odb.config import PLAN_OPTIONS, ODBConfig
from odb.epoch.global_step import foreign_keys
from odb.epoch.run_state import retained_positions
from odb.resume.elastic import check_group, rank_order, repartition
from odb.resume.state import STATE_VERSION, check_state, cursor_state, upgrade
from odb.data.batch_shard import BatchShardSampler
from odb.data.sampling import EpochShuffleSampler, ShardSampler, sampler_settings
from odb.data.source import SampleMeter


class PlanOptions:
    """The plan options of a config as JSON gives them back (tuples become lists), so saved and current
    compare equal; computed once per config (``state_dict`` may run every step).

    Example:
        >>> PlanOptions()(ODBConfig(token_budget=64))["token_budget"]
        64
    """

    def __init__(self) -> None:
        self.cfg: Optional[ODBConfig] = None
        self.values: Dict[str, Any] = {}

    def __call__(self, cfg: ODBConfig) -> Dict[str, Any]:
        if self.cfg is not cfg:
            self.values = json.loads(json.dumps({k: getattr(cfg, k) for k in PLAN_OPTIONS}))
            self.cfg = cfg
        return dict(self.values)


def loader_fields(dataset: Any, sampler: Any, num_workers: int, options: Dict[str, Any], iterable: bool
                  ) -> Dict[str, Any]:
    """What a saved state must match on the loader that loads it: the dataset's size, whether it is
    iterable, the plan options, the sampler's class and settings, the worker count.

    Example:
        >>> loader_fields(range(3), [0, 1, 2], 0, {}, iterable=False)["sampler"]
        {'kind': 'list'}
    """
    return dict(dataset_len=None if iterable else len(dataset), iterable=iterable, options=options,
                sampler=None if iterable else (sampler_settings(sampler) or {"kind": type(sampler).__name__}),
                num_workers=int(num_workers))


def saved_state(run: Any, cursor: Any, *, finished_epoch: Optional[int], next_epoch: int, seed: int,
                wait_s: float, accumulation: Optional[int], rank: int, world_size: int, fields: Dict[str, Any],
                budget: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The loader's state (see ``ODBDataLoader.state_dict``): ``run``/``cursor`` are the current epoch's
    EpochRun and the Cursor of the last batch the training loop received (None before any epoch),
    ``finished_epoch`` the last epoch that ran to its end, ``fields`` from ``loader_fields``; ``budget``:
    the loader's budget state (token_budget="auto": its AutoBudget's; None for a fixed budget)."""
    run_state = None
    if run is not None and finished_epoch != run.epoch:
        # The batches the training loop received, not what the background thread planned ahead.
        run_state = cursor_state(cursor, accumulation)
        run_state["stats"]["wait_s"] = wait_s
        position = run_state["position"]
        if run.stream_marks is not None:  # a later restart point of the stream, if the batches since allow
            later = run.stream_marks.cut(min(retained_positions(run_state), default=position["arrived"]),
                                         prune=False)
            if later is not None and later["start"] > position["stream"]["start"]:
                position["stream"] = later
        # After an epoch's last batch the epoch is over even if the iterator was not exhausted.
        if run_state["aligner"]["all_done"] and not position["pending"] and \
                position["micro_pos"] >= len(position["micro"]):
            run_state = None
    return {"odb_state_version": STATE_VERSION, "epoch": run.epoch if run_state is not None else next_epoch,
            "seed": seed, "world_size": world_size, "rank": rank, "dataset_len": fields["dataset_len"],
            "iterable": fields["iterable"], "options": fields["options"], "sampler": fields["sampler"],
            "num_workers": fields["num_workers"], "budget": budget, "run": run_state}


def state_to_resume(state: Union[Dict[str, Any], Sequence[Dict[str, Any]]], *, rank: int, world_size: int,
                    sampler: Any, own_sampler: bool, fields: Dict[str, Any]) -> Dict[str, Any]:
    """This rank's state to resume from ``state`` (its own, or every rank's: re-partitioned on another
    world size), checked against the loader's ``fields``; ``own_sampler``: the loader shuffles with its
    own seeded sampler. Raises ValueError with the reason and the fix (see ``load_state_dict``)."""
    iterable = fields["iterable"]
    if isinstance(state, (list, tuple)):
        states = [upgrade(one) for one in state]
        for one in states:
            check_state(one, world_size=world_size, rank=rank, any_rank=True, **fields)
        mine = [s for s in states if s["world_size"] == world_size and s["rank"] == rank]
        if len(states) == world_size and len(mine) == 1:
            state = mine[0]  # the same world size: exactly where this rank stopped
        else:
            state = repartition(check_group(states, sampler, iterable), sampler, world_size, rank)
    else:
        state = upgrade(state)
        check_state(state, world_size=world_size, rank=rank, **fields)
    if not own_sampler and not _replayable(sampler) and not iterable:
        raise ValueError(f"odb cannot resume mid-epoch with sampler {type(sampler).__name__}: its order "
                         f"is not a function of (seed, epoch). Fix: use shuffle=True of ODBDataLoader (seeded), "
                         f"odb.ShardSampler, DistributedSampler, a SequentialSampler or a fixed list of indices.")
    return state


def resume_order(sampler: Any, run_state: Optional[Dict[str, Any]], epoch: int, rank: int, world_size: int
                 ) -> Optional[np.ndarray]:
    """This rank's order of a resumed epoch that was re-partitioned (None: the sampler's own)."""
    if run_state is None or not run_state["position"]["layers"]:
        return None
    return rank_order(sampler, run_state["position"]["layers"], world_size, rank, epoch)


def retained_samples(source: Any, run_state: Dict[str, Any], *, dataset: Any, sampler: Any, iterable: bool,
                     transform: Any, cfg: ODBConfig, known: Any = None, order: Optional[np.ndarray] = None
                     ) -> Dict[int, Any]:
    """The samples a resumed epoch needs again (carried, planned, ghost), as
    position -> (dataset index, sample, meta)."""
    positions = sorted(retained_positions(run_state))
    # Samples planned here from other ranks (step_plan="global", saved inside a step): read by dataset index
    foreign = foreign_keys(retained_positions(run_state, foreign=True) - set(positions))
    if iterable:  # read again from the stream's restart point (or its start)
        if foreign:
            raise ValueError(f"odb cannot resume this stream here: the state was saved inside an optimizer step "
                             f"planned across ranks (step_plan='global'), and {len(foreign)} of the samples this "
                             f"rank still owed came from other ranks' streams, which it cannot read again. Fix: "
                             f"save at an optimizer step's end (HF Trainer and Accelerate's save_state do), or "
                             f"pass step_plan='rank'.")
        stream, arrived = run_state["position"]["stream"], run_state["position"]["arrived"]
        return source.skip(arrived - (stream["start"] if stream else 0), positions)
    indices = _indices_at(sampler if order is None else order, positions)
    keys, indices = positions + list(foreign), indices + list(foreign.values())
    if known is not None:  # index-only records: nothing to read
        return {p: (i, i, (tuple(int(v) for v in known[i]), 0, 0)) for p, i in zip(keys, indices)}
    meter = SampleMeter(cfg)
    out = {}
    for p, i in zip(keys, indices):
        sample = dataset[i] if transform is None else transform(dataset[i])
        out[p] = (i, sample, meter(i, sample))
    return out


def _indices_at(order: Any, positions: List[int]) -> List[int]:
    """Dataset indices at ascending ``positions`` of an epoch's order (read up to the last one)."""
    if not positions:
        return []
    head = list(itertools.islice(iter(order), positions[-1] + 1))
    if len(head) <= positions[-1]:
        raise ValueError(f"odb state holds position {positions[-1]} of the epoch's order, but the sampler yields only "
                         f"{len(head)} indices: the sampler differs from the saved run's. Fix: build the loader with "
                         f"the saved sampler and its settings.")
    return [int(head[p]) for p in positions]


def _replayable(sampler: Any) -> bool:
    """Samplers whose order is a function of (seed, epoch), so a resumed epoch sees the same order (a
    BatchShardSampler: when the order it deals is, or it says so)."""
    if isinstance(sampler, BatchShardSampler):
        return sampler.replayable or _replayable(sampler.sampler)
    return isinstance(sampler, (SequentialSampler, DistributedSampler, ShardSampler, EpochShuffleSampler, list,
                                tuple, range))
