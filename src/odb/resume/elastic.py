"""Elastic resume: an epoch saved mid-way by W ranks continues on W' ranks (map-style data).

Under the stride rule (``odb.data.sampling.global_order``) rank r of W reads positions r, r + W,
r + 2W, ... of one global order. Every rank's state says how many positions of its share
it consumed (``arrived``) and which of those it still held (carried, planned, not yet
emitted). Together they name the positions of the global order that no rank emitted: the
unread tail of every share plus the held samples. That remaining order, kept as a
``layer`` ({world, arrived, kept, total}: O(W + held samples) integers), is what the W'
ranks continue from, again by the stride rule: rank r' takes ``remaining[r'::W']``. Held
samples are read again by index on whichever rank they land; every remaining sample is
emitted exactly once, none twice. A second re-partition of the same epoch adds a layer on
top of the first; the next epoch uses the sampler's own order again.

Example:
    >>> layer = {"world": 2, "arrived": [2, 1], "kept": [2], "total": 7}
    >>> remaining(layer).tolist()   # rank 0 read 0, 2 (2 still held), rank 1 read 1
    [2, 3, 4, 5, 6]
"""

from __future__ import annotations

import warnings
from typing import Any, Dict, List, Optional, Sequence

import numpy as np

from odb.data.sampling import global_order, stride_sharded
from odb.epoch.auto import merged_state
from odb.epoch.global_step import foreign_index
from odb.epoch.run_state import fresh_run_state, retained_positions


def remaining(layer: Dict[str, Any]) -> np.ndarray:
    """Positions (ascending) of the order a layer applies to that no rank emitted."""
    total, world = int(layer["total"]), int(layer["world"])
    keep = np.ones(total, dtype=bool)
    for rank, arrived in enumerate(layer["arrived"]):
        keep[rank:rank + int(arrived) * world:world] = False
    keep[np.asarray(layer["kept"], dtype=np.int64)] = True
    return np.flatnonzero(keep)


def layered_order(sampler: Any, layers: Sequence[Dict[str, Any]], epoch: int) -> np.ndarray:
    """The global order (dataset indices) after every re-partition in ``layers``."""
    order = global_order(sampler, int(layers[0]["world"]), epoch)
    for depth, layer in enumerate(layers):
        if int(layer["total"]) != len(order):
            raise ValueError(f"odb state re-partition {depth} covers {layer['total']} positions but the sampler's "
                             f"order has {len(order)} at that point: the sampler or dataset differs from the saved "
                             f"run's. Fix: build the loader with the saved dataset and sampler settings.")
        order = order[remaining(layer)]
    return order


def rank_order(sampler: Any, layers: Sequence[Dict[str, Any]], world: int, rank: int,
               epoch: int) -> Optional[np.ndarray]:
    """This rank's order of an epoch (dataset indices); None when it is the sampler's own (no layers)."""
    if not layers:
        return None
    return layered_order(sampler, layers, epoch)[rank::world]


def repartition(states: List[Dict[str, Any]], sampler: Any, world: int, rank: int) -> Dict[str, Any]:
    """The state rank ``rank`` of ``world`` resumes from, given every old rank's state (checked by
    ``check_group``): a fresh run over its share of what no old rank emitted."""
    running = [s for s in states if s["run"] is not None]
    step = int(running[0]["run"]["position"]["step"]) if running else 0
    budget = _merged_budget(states, step)
    if not running:
        return dict(states[0], world_size=world, rank=rank, run=None, budget=budget)
    epoch, prior = int(running[0]["epoch"]), list(running[0]["run"]["position"]["layers"])
    old_world = len(states)
    order = layered_order(sampler, prior, epoch) if prior else global_order(sampler, old_world, epoch)
    total = len(order)
    arrived, kept, owed = [], [], []
    for r, state in enumerate(states):
        run = state["run"]
        if run is None:  # this rank's data had ended (join=False): its whole share was emitted
            arrived.append(len(range(r, total, old_world)))
            continue
        arrived.append(int(run["position"]["arrived"]))
        held = retained_positions(run, ghost=False)  # the ghost is a copy, not a sample still owed
        kept.extend(p * old_world + r for p in held)
        # samples of other ranks held here (saved inside a step planned across ranks): owed by dataset index
        owed.extend(foreign_index(k) for k in retained_positions(run, ghost=False, foreign=True) - held)
    kept.extend(read_positions_of(owed, order, arrived, set(kept)))
    layer = {"world": old_world, "arrived": arrived, "kept": sorted(kept), "total": total}
    return dict(running[0], epoch=epoch, world_size=world, rank=rank,
                run=fresh_run_state(step, prior + [layer]), budget=budget)


def read_positions_of(indices: List[int], order: np.ndarray, arrived: List[int], taken: set) -> List[int]:
    """Positions of the global ``order`` holding the dataset ``indices``, among those their rank had read
    (``arrived[r]`` positions of rank r's share r, r + W, ...) and that are not ``taken``: where samples that
    one rank planned for another (odb.epoch.global_step) came from. One position per index, however often it
    occurs.

    Example:
        >>> read_positions_of([7], np.array([5, 7, 9, 7]), [1, 2], set())
        [3]
    """
    if not indices:
        return []
    world = len(arrived)
    q = np.arange(len(order))
    read = q[(q // world) < np.asarray(arrived)[q % world]]
    free: Dict[int, List[int]] = {}
    for pos in read.tolist():
        if pos not in taken:
            free.setdefault(int(order[pos]), []).append(pos)
    out = []
    for i in indices:
        if not free.get(int(i)):
            raise ValueError(f"odb rank states hold dataset index {i} for another rank, but no rank had read it "
                             f"at a position still owed: the states are not of one run. Fix: pass the states of "
                             f"ranks 0..W-1 saved at the same step.")
        out.append(free[int(i)].pop())
    return out


def _merged_budget(states: List[Dict[str, Any]], step: int) -> Optional[Dict[str, Any]]:
    """The loader budget's state of every new rank: token_budget="auto"'s merged (odb.epoch.auto.merged_state:
    the most conservative old rank's AutoBudget, no frozen window plans); None for a fixed budget."""
    if all(s["budget"] is None for s in states):
        return None
    return merged_state([s["budget"] for s in states], step)


def check_group(states: Any, sampler: Any, iterable: bool) -> List[Dict[str, Any]]:
    """Every old rank's state, in rank order, after checking that they describe one run that can be
    re-partitioned (each state was already checked on its own)."""
    if iterable:
        raise ValueError("odb got a list of rank states for an IterableDataset: only map-style data can be "
                         "re-partitioned over another number of ranks (a stream has no positions to hand to "
                         "other ranks). Fix: resume with the saved world size, each rank loading its own state.")
    if not stride_sharded(sampler):
        raise ValueError(f"odb cannot re-partition an epoch read by sampler {type(sampler).__name__}: it needs "
                         f"the stride rule (rank r of W reads positions r, r + W, ... of one global order). Fix: "
                         f"build the loaders with odb.ShardSampler or DistributedSampler, before saving and after.")
    by_rank = sorted(states, key=lambda s: s["rank"])
    worlds, ranks = {s["world_size"] for s in by_rank}, [s["rank"] for s in by_rank]
    if worlds != {len(by_rank)} or ranks != list(range(len(by_rank))):
        raise ValueError(f"odb got {len(by_rank)} rank states with world sizes {sorted(worlds)} and ranks {ranks}: "
                         f"a re-partition needs exactly one state of every rank of the saved run. Fix: pass the "
                         f"states of ranks 0..W-1 saved at the same step.")
    seeds = {s["seed"] for s in by_rank}
    running = [s for s in by_rank if s["run"] is not None]
    epochs = {s["epoch"] for s in running}
    ended = {s["epoch"] for s in by_rank if s["run"] is None}
    steps = {s["run"]["position"]["step"] for s in running}
    layers = {repr(s["run"]["position"]["layers"]) for s in running}
    if len(seeds) > 1 or len(epochs) > 1 or len(steps) > 1 or len(layers) > 1 or (
            running and ended - {next(iter(epochs)) + 1}) or len(ended) > 1:
        raise ValueError(f"odb rank states disagree (seeds {sorted(seeds)}, epochs {sorted(epochs)} with ended "
                         f"ranks at {sorted(ended)}, steps {sorted(steps)}, {len(layers)} re-partition histories): "
                         f"they were not saved by one run at one step. Fix: save every rank at the same step (as "
                         f"checkpoints do) and pass all of them.")
    if any(0 < s["run"]["position"]["micro_pos"] < len(s["run"]["position"]["micro"]) for s in running):
        warnings.warn("odb rank states were saved inside an optimizer step (gradient accumulation): a re-partition "
                      "starts a new optimizer step, so the micro-batches already consumed of that step were scaled "
                      "for a step that will not complete. Save at optimizer-step boundaries (as trainers do).",
                      stacklevel=3)
    return by_rank
