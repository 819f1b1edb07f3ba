"""The benchmark section "scale": step efficiency against world size, at the user's samples per step.

Every arm trains the same G = s x W samples per optimizer step (s per rank, W ranks) under the same memory
cap (``TOKEN_BUDGET`` padded tokens per micro-batch); a micro-batch costs its padded tokens plus a fixed
``OVERHEAD`` (odb's ``micro_batch_cost``: a forward and backward pass over the weights).

Figures of one optimizer step (``step_efficiency``), with R the step's real tokens:

* DDP step efficiency = (R / W + overhead) / max over ranks of (the rank's padded tokens + its micro-batches
  x overhead): the ranks meet once a step, so the slowest rank sets its time. A rank's padded tokens are the
  sum over its micro-batches of samples x longest sample (a packed row: its real tokens); a ghost
  micro-batch (``ODBStepInfo.is_ghost``) costs the overhead alone.
* FSDP step efficiency: the same numerator over the sum over micro-steps j of the max over ranks of (rank
  r's micro-batch j padded tokens + overhead): the ranks meet at every micro-step (a rank with fewer
  micro-batches runs ghosts there).
* bound: what any plan could reach for the step, (R / W + overhead) / max(R / W + overhead, longest sample
  + overhead): below 1 where one sample outweighs a rank's fair share.

Arms (``ARMS``): ``fixed`` (DistributedSampler shares cut into batches of the largest B whose worst case
fits the cap), ``group_by_length`` (transformers' LengthGroupedSampler as Trainer builds it, batches dealt
to ranks as Accelerate's BatchSamplerShard deals them), ``batch_rebalance`` (transformers'
BatchRebalanceSampler for every rank), and odb's ``ODBDataLoader`` on every rank as thread ranks
(odb.comm.threads): each rank plans its own share (``odb_rank``, padded and packed) or the step is planned
across ranks (``odb_global``, padded and packed: ``step_plan="global"``, where the installed odb has it).
Lengths: two real heavy-tailed sets (odb.bench.realdata) clipped to [``MIN_LENGTH``, ``MAX_LENGTH``].

    >>> from odb.bench.scale import MicroBatch, step_efficiency
    >>> step = [[MicroBatch(100, 100, 100)], [MicroBatch(100, 100, 100)]]
    >>> step_efficiency(step)["ddp"]
    1.0
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DistributedSampler

import odb
from odb.private_api import read
from odb.comm.threads import ThreadRanks

from odb.bench.step_figures import OVERHEAD, TOKEN_BUDGET, MicroBatch, Step, draw, step_efficiency  # noqa: F401
MIN_LENGTH, MAX_LENGTH = 8, 1024
FIXED_B = TOKEN_BUDGET // MAX_LENGTH  # the largest B whose worst case (B x MAX_LENGTH) fits: 4

WORLDS = (2, 8, 32, 128, 1024)
SHARES = (1, 4, 16)
# optimizer steps per cell (every arm reads exactly steps x G samples: one epoch)
STEPS = {2: 16, 8: 16, 32: 16, 128: 12, 1024: 3}
QUICK_WORLDS, QUICK_SHARES, QUICK_STEPS = (2, 8), (4,), 3
# BatchRebalanceSampler plans at most this many samples per cell (whole steps, at least one): its plan of one
# step of 16,384 samples takes 35-110 s here (hill climbing in Python), on every rank
REBALANCE_MAX_SAMPLES = 16384
# up to this world size odb's global arms run through ODBDataLoader on thread ranks; above it the step plan
# every rank computes (plan_global_step over the step's samples) is computed once (see run_scale's notes)
GLOBAL_LOADER_MAX_WORLD = 32
# Arms left out of a cell, with the reason: (workload, world, share or None for every share) -> arm -> why.
# The gettext set at 1,024 ranks is bounded by its longest sample in every arm that plans a step (the table's
# bound); its per-rank loaders added ~90 s to the section and BatchRebalance's one step at 16 per rank 87 s.
_LOADERS_1024 = "1,024 thread-rank loaders (~90 s for the three cells here): run on the ShareGPT set only"
SKIP: Dict[Tuple[str, int, Optional[int]], Dict[str, str]] = {
    ("gettext", 1024, None): {"odb_rank": _LOADERS_1024, "odb_rank_packed": _LOADERS_1024},
    ("gettext", 1024, 16): {"batch_rebalance": "its own plan of one step of 16,384 samples took 87 s here (ShareGPT's "
                                               "~25 s, in its table)"},
}
PLAN_TIMING = (1024, 16)  # world x share at which plan_global_step is timed
PLAN_MS_MAX = 20.0

WORKLOADS = {"sharegpt": "sharegpt-gpt2", "gettext": "gettext-en-de"}
WORKLOAD_TEXT = {
    "sharegpt": "ShareGPT conversations, GPT-2 tokens per conversation",
    "gettext": "Debian gettext English->German message pairs, GPT-2 tokens of source + target as one sequence",
}
ARMS = ("fixed", "group_by_length", "batch_rebalance", "odb_rank", "odb_rank_packed", "odb_global",
        "odb_global_packed")
ARM_LABELS = {"fixed": "fixed", "group_by_length": "group_by_length", "batch_rebalance": "BatchRebalance",
              "odb_rank": "odb per-rank", "odb_rank_packed": "odb per-rank packed", "odb_global": "odb global",
              "odb_global_packed": "odb global packed"}
GLOBAL_ARMS = ("odb_global", "odb_global_packed")
NOT_AVAILABLE = "not available in this build"


def spread(values: Sequence[float]) -> Dict[str, float]:
    """Median and the 10th and 90th percentiles.

    Example:
        >>> spread([1.0, 2.0, 3.0])
        {'median': 2.0, 'p10': 1.2, 'p90': 2.8}
    """
    x = np.asarray(values, dtype=np.float64)
    return {"median": float(np.median(x)), "p10": float(np.percentile(x, 10)), "p90": float(np.percentile(x, 90))}


def micro_batch(lengths: np.ndarray, idx: Sequence[int], packed: bool = False) -> Optional[MicroBatch]:
    """The micro-batch of the samples ``idx`` (None when empty: a ghost).

    Example:
        >>> micro_batch(np.array([5, 9, 2]), [0, 2]), micro_batch(np.array([5, 9, 2]), [0, 2], packed=True)
        (MicroBatch(padded=10, real=7, longest=5), MicroBatch(padded=7, real=7, longest=5))
    """
    if len(idx) == 0:
        return None
    x = lengths[np.asarray(idx, dtype=np.int64)]
    real, longest = int(x.sum()), int(x.max())
    return MicroBatch(real if packed else len(x) * longest, real, longest)


# ---- lengths ---------------------------------------------------------------------------------------------
def real_lengths(name: str) -> np.ndarray:
    """The real set ``name`` (a key of ``WORKLOADS``) as one length per sample, clipped to [MIN, MAX]."""
    from odb.bench.realdata import load_real_lengths

    x = np.asarray(load_real_lengths(WORKLOADS[name]), dtype=np.int64)
    if x.ndim == 2:  # (source, target) pairs: one decoder-only sequence
        x = x.sum(axis=1)
    return np.clip(x, MIN_LENGTH, MAX_LENGTH)


class _Sized:
    """What DistributedSampler needs of a dataset: its length."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


def rank_orders(n: int, world: int, seed: int = 0) -> List[List[int]]:
    """Every rank's DistributedSampler order (shuffle=True, ``seed``, epoch 0).

    Every rank's sampler draws the same permutation and takes every W-th index of it: drawn once here (W
    samplers would draw it W times), and checked against the real sampler of the first and the last rank."""
    data = _Sized(n)

    def sampler(rank: int) -> DistributedSampler:
        return DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=seed)  # type: ignore

    first = sampler(0)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    total = first.total_size
    perm += perm[:total - n] if total - n <= n else (perm * math.ceil(total / n))[:total - n]
    orders = [perm[r:total:world] for r in range(world)]
    if list(first) != orders[0] or list(sampler(world - 1)) != orders[-1]:
        raise RuntimeError("scale: DistributedSampler's order is not the one drawn here (its shuffle changed)")
    return orders


def per_rank_batch(share: int) -> Tuple[int, int]:
    """The fixed-size arms' (B, A): B the largest batch whose worst case fits the cap, at most the share;
    A = share / B micro-batches per step.

    Example:
        >>> per_rank_batch(1), per_rank_batch(4), per_rank_batch(16)
        ((1, 1), (4, 1), (4, 4))
    """
    b = min(FIXED_B, share)
    if share % b:
        raise ValueError(f"scale: {share} samples per rank and step is no multiple of the batch size {b}. "
                         f"Fix: use a share <= {FIXED_B} or a multiple of {FIXED_B}.")
    return b, share // b


# ---- the sampler arms (computed from the samplers' own orders) ------------------------------------------
Plan = List[List[List[List[int]]]]  # plan[step][rank][micro-step]: sample indices


def to_steps(lengths: np.ndarray, plan: Plan, packed: bool = False) -> List[Step]:
    """The micro-batches of a plan of sample indices."""
    return [[[micro_batch(lengths, mb, packed) for mb in rank] for rank in step] for step in plan]


def _steps_of(per_rank: List[List[List[int]]], accumulation: int) -> Plan:
    """Steps of ``accumulation`` consecutive batches of every rank's batch list."""
    n_steps = min(len(b) for b in per_rank) // accumulation
    return [[batches[k * accumulation:(k + 1) * accumulation] for batches in per_rank] for k in range(n_steps)]


def fixed_plan(n: int, world: int, share: int, seed: int = 0) -> Plan:
    """``DataLoader(batch_size=B, sampler=DistributedSampler(shuffle=True, seed))`` on every rank, A batches a step."""
    b, acc = per_rank_batch(share)
    return _steps_of([[o[i:i + b] for i in range(0, len(o), b)] for o in rank_orders(n, world, seed)], acc)


def group_by_length_order(lengths: np.ndarray, share: int, seed: int = 0) -> List[int]:
    """The order of Trainer's LengthGroupedSampler (``train_batch_size x gradient_accumulation_steps``, the whole
    dataset, the same on every rank; Trainer seeds torch's RNG alike on every rank, here a seeded generator)."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    b, acc = per_rank_batch(share)
    sampler = LengthGroupedSampler(b * acc, lengths=lengths.tolist(), generator=torch.Generator().manual_seed(seed))
    return [int(i) for i in sampler]


def group_by_length_plan(lengths: np.ndarray, world: int, share: int, seed: int = 0) -> Plan:
    """Trainer with ``group_by_length=True``: ``DataLoader(batch_size=B, sampler=LengthGroupedSampler(B x A))``,
    whose batches Accelerate's BatchSamplerShard deals round-robin (batch k to rank k mod W); A a step."""
    b, acc = per_rank_batch(share)
    order = group_by_length_order(lengths, share, seed)
    batches = [order[i:i + b] for i in range(0, len(order), b)]
    return _steps_of([batches[r::world] for r in range(world)], acc)


def batch_rebalance_plan(lengths: np.ndarray, world: int, share: int, every_rank: bool = False,
                         max_steps: Optional[int] = None, plan_s: Optional[List[float]] = None,
                         shuffle: bool = True) -> Plan:
    """``BatchRebalanceSampler(lengths, effective_batch_size=G, dp_size=W, grad_accum=A, rank=r)`` at its
    defaults (seed 42, shuffle, drop_last). Every rank runs the same deterministic plan of each step and yields
    its part; that plan is computed once (rank 0's sampler, all ranks' parts kept), or with ``every_rank``
    each rank's own sampler is iterated (the same micro-batches, W times the cost). ``max_steps``: the first
    steps only; ``plan_s`` receives the seconds of each step's plan (the sampler's own ``_assign``); ``shuffle``:
    the sampler's own (False: its steps are the dataset's order cut every G samples)."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    _, acc = per_rank_batch(share)
    g = share * world
    as_list = lengths.tolist()
    take = None if max_steps is None else max_steps * acc
    if every_rank:
        return _steps_of([[list(mb) for mb in itertools.islice(
            BatchRebalanceSampler(as_list, effective_batch_size=g, dp_size=world, grad_accum=acc, rank=r,
                                  shuffle=shuffle), take)] for r in range(world)], acc)
    sampler = BatchRebalanceSampler(as_list, effective_batch_size=g, dp_size=world, grad_accum=acc, rank=0,
                                    shuffle=shuffle)
    plans: Plan = []
    assign = read(sampler, "BatchRebalanceSampler", "_assign")  # one step's plan: rank -> its A micro-batches

    def keep(indices: Any, batch_lengths: Any) -> Any:
        t0 = time.perf_counter()
        plans.append(assign(indices, batch_lengths))
        if plan_s is not None:
            plan_s.append(time.perf_counter() - t0)
        return plans[-1]

    sampler._assign = keep  # type: ignore[method-assign]
    rank0 = list(itertools.islice(sampler, take))
    if [mb for p in plans for mb in p[0]] != rank0:
        raise RuntimeError("scale: BatchRebalanceSampler yielded other micro-batches than its plans hold")
    return [[[list(mb) for mb in rank] for rank in plan] for plan in plans]


def batch_rebalance_same_steps_plan(lengths: np.ndarray, world: int, share: int,
                                    max_steps: Optional[int] = None) -> Plan:
    """BatchRebalanceSampler's plan of the fixed arm's steps, which are the odb arms' (the next ``share`` of each
    rank's DistributedSampler order): its public ``shuffle=False`` over the samples put in that order, so that its
    k-th step holds theirs (a comparison on the same samples, free of which samples each shuffle drew)."""
    orders = rank_orders(len(lengths), world)
    order = np.array([i for k in range(len(orders[0]) // share) for o in orders for i in o[k * share:(k + 1) * share]],
                     dtype=np.int64)
    plan = batch_rebalance_plan(lengths[order], world, share, max_steps=max_steps, shuffle=False)
    return [[[order[mb].tolist() for mb in rank] for rank in step] for step in plan]


# ---- the odb arms ----------------------------------------------------------------------------------------
def has_step_plan() -> bool:
    """Whether the installed odb has the option ``step_plan`` (a step planned across ranks)."""
    return "step_plan" in getattr(odb.ODBConfig, "__dataclass_fields__", {})


def _global_planner() -> Optional[Callable[..., Any]]:
    try:
        from odb.plan.steps.global_plan import plan_global_step
    except ImportError:
        return None
    return plan_global_step


def odb_options(world: int, share: int, layout: str, step_plan: Optional[str]) -> Dict[str, Any]:
    """The ODBDataLoader options of an odb arm: the user's G, the cap and micro_batch_cost, defaults otherwise."""
    options: Dict[str, Any] = {"token_budget": TOKEN_BUDGET, "micro_batch_cost": OVERHEAD,
                               "global_batch_size": share * world, "layout": layout}
    if step_plan is not None and has_step_plan():
        options["step_plan"] = step_plan
    return options


def odb_loader_steps(lengths: np.ndarray, world: int, share: int, layout: str = "padded",
                     step_plan: Optional[str] = None, seed: int = 0, timeout_s: float = 600.0
                     ) -> Tuple[List[Step], List[Dict[str, Any]]]:
    """One epoch of ``odb.ODBDataLoader`` on each of ``world`` thread ranks (one thread each, exchanging through
    odb.comm.threads.ThreadRanks): a map-style dataset of the lengths, ``DistributedSampler(shuffle=True,
    seed)``, known ``lengths=``, ``num_workers=0``, a collate that returns the samples (their lengths).

    Returns the steps (from each batch's ODBStepInfo: padded and real tokens, ghosts, micro-steps) and, per
    step, the micro-step counts the ranks' infos gave and the step's sample ids (all ranks)."""
    data = lengths.tolist()
    options = odb_options(world, share, layout, step_plan)
    ranks = ThreadRanks(world, timeout_s=timeout_s)
    got: List[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True,  # type: ignore
                                         seed=seed)
            loader = odb.ODBDataLoader(data, sampler=sampler, num_workers=0, collate_fn=list, lengths=lengths,
                                       exchange=ranks.exchanges(rank), **options)
            out = []
            for batch in loader:
                info = odb.pop_step_info(batch)
                out.append((info, [int(x) for x in batch]))
            got[rank] = out
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            got[rank] = err
            ranks.abort()

    threads = [threading.Thread(target=run, args=(r,), daemon=True, name=f"scale-rank-{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s * 4)
    if any(t.is_alive() for t in threads):
        ranks.abort()
        raise RuntimeError(f"scale: a rank thread of {world} still runs after {timeout_s * 4:.0f} s")
    errors = [(r, e) for r, e in enumerate(got) if isinstance(e, BaseException)]
    if errors:  # the first failure (others may only have seen the abort)
        first = next(((r, e) for r, e in errors if "abort" not in repr(e).lower()), errors[0])
        raise RuntimeError(f"scale: rank {first[0]} of {world} raised {first[1]!r}") from first[1]
    return _odb_steps(got, world)


def _odb_steps(got: List[List[Tuple[Any, List[int]]]], world: int) -> Tuple[List[Step], List[Dict[str, Any]]]:
    per_rank: List[List[List[Tuple[Any, List[int]]]]] = []
    for batches in got:
        steps: List[List[Tuple[Any, List[int]]]] = [[]]
        for info, samples in batches:
            if info.micro_step != len(steps[-1]):
                raise RuntimeError(f"scale: micro-step {info.micro_step} came at position {len(steps[-1])}")
            steps[-1].append((info, samples))
            if info.is_last_micro_step:
                steps.append([])
        if steps[-1]:
            raise RuntimeError("scale: an epoch ended inside an optimizer step")
        per_rank.append(steps[:-1])
    if len({len(s) for s in per_rank}) != 1:
        raise RuntimeError(f"scale: the ranks ran {sorted({len(s) for s in per_rank})} optimizer steps")
    out: List[Step] = []
    held: List[Dict[str, Any]] = []
    for k in range(len(per_rank[0])):
        step: Step = []
        ids: List[int] = []
        micro_steps = set()
        for r in range(world):
            rank_step: List[Optional[MicroBatch]] = []
            for info, batch in per_rank[r][k]:
                micro_steps.add(int(info.micro_steps))
                if info.is_ghost:
                    rank_step.append(None)
                    continue
                rank_step.append(MicroBatch(int(info.padded_tokens), int(info.real_tokens), max(batch)))
                ids += [int(i) for i in info.sample_ids]
            step.append(rank_step)
        out.append(step)
        held.append({"micro_steps": sorted(micro_steps), "sample_ids": sorted(ids)})
    return out, held


def global_direct_steps(lengths: np.ndarray, world: int, share: int, layout: str = "padded", seed: int = 0,
                        times: Optional[List[Tuple[float, float]]] = None) -> List[Step]:
    """odb's global step plan computed once per step: ``plan_global_step`` over the step's samples, rank after
    rank, each rank's next ``share`` of its DistributedSampler order, with the loader's cost model and overhead
    (what every rank of ``ODBDataLoader(step_plan="global")`` computes, the same on each; known lengths move no
    sample). ``times`` receives (wall, CPU) seconds per plan."""
    from odb.plan.costs.cost import CostModel

    plan_global_step = _global_planner()
    if plan_global_step is None:
        raise RuntimeError(NOT_AVAILABLE)
    cfg = odb.ODBConfig(**odb_options(world, share, layout, "global"))
    cost = CostModel.from_config(cfg)
    orders = rank_orders(len(lengths), world, seed)
    out: List[Step] = []
    for k in range(len(orders[0]) // share):
        positions = np.array([i for o in orders for i in o[k * share:(k + 1) * share]], dtype=np.int64)
        table = lengths[positions].reshape(-1, 1)
        t0, c0 = time.perf_counter(), time.thread_time()
        plan = plan_global_step(table, world, cost, float(cfg.micro_batch_cost))
        if times is not None:
            times.append((time.perf_counter() - t0, time.thread_time() - c0))
        if len(plan.oversize):
            raise RuntimeError("scale: a sample over the budget (none is: lengths are clipped)")
        out.append([[micro_batch(lengths, positions[g], packed=layout == "packed") for g in groups]
                    for groups in plan.ranks])
    return out


def time_global_plan(lengths: np.ndarray, world: int, share: int, layout: str, repeats: int) -> Dict[str, Any]:
    """Wall and CPU milliseconds of ``plan_global_step`` on ``repeats`` steps of ``world x share`` samples drawn
    from ``lengths`` (the loader's cost model and overhead, as ``global_direct_steps``)."""
    times: List[Tuple[float, float]] = []
    global_direct_steps(draw(lengths, world * share * repeats, seed=7), world, share, layout, times=times)
    wall, cpu = [1e3 * t for t, _ in times], [1e3 * c for _, c in times]
    return {"world": world, "share": share, "samples": world * share, "repeats": len(times),
            "ms_median": statistics.median(wall), "ms_max": max(wall), "cpu_ms_median": statistics.median(cpu),
            "cpu_ms_max": max(cpu)}


# ---- one cell, every arm ---------------------------------------------------------------------------------
def _summary(steps: List[Step], g: int) -> Dict[str, Any]:
    effs = [step_efficiency(s) for s in steps]
    sizes = [m.padded for s in steps for rank in s for m in rank if m is not None]
    micro = [max(len(rank) for rank in s) for s in steps]
    ghosts = sum(m is None for s in steps for rank in s for m in rank)
    cells = sum(len(rank) for s in steps for rank in s)
    return {"ddp": spread([e["ddp"] for e in effs]), "fsdp": spread([e["fsdp"] for e in effs]),
            "bound": spread([e["bound"] for e in effs]), "cap_bound": spread([e["cap_bound"] for e in effs]),
            "steps": len(steps), "global_batch_size": g,
            "micro_steps_mean": float(np.mean(micro)), "ghost_share": ghosts / max(cells, 1),
            "max_micro_batch_tokens": int(max(sizes)),
            "over_cap_share": float(np.mean(np.asarray(sizes) > TOKEN_BUDGET))}


def same_steps(a: List[Step], b: List[Step]) -> bool:
    """Whether two runs hold the same micro-batch costs in every (step, rank, micro-step)."""
    return len(a) == len(b) and all(x == y for x, y in zip(a, b))


def run_cell(lengths: np.ndarray, world: int, share: int, arms: Sequence[str] = ARMS,
             global_loader_max_world: int = GLOBAL_LOADER_MAX_WORLD,
             skip: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Every arm on one (world, share) over one epoch of ``lengths`` (a multiple of share x world samples);
    ``skip``: arms left out, with the reason."""
    g = share * world
    out: Dict[str, Any] = {"world": world, "share": share, "global_batch_size": g, "samples": int(len(lengths)),
                           "arms": {}}
    rebalance_s: List[float] = []
    kept: Dict[str, List[Step]] = {}
    max_rebalance = max(1, REBALANCE_MAX_SAMPLES // g)
    runners: Dict[str, Callable[[], Tuple[List[Step], str]]] = {
        "fixed": lambda: (to_steps(lengths, fixed_plan(len(lengths), world, share)), "DistributedSampler orders"),
        "group_by_length": lambda: (to_steps(lengths, group_by_length_plan(lengths, world, share)),
                                    "LengthGroupedSampler order"),
        "batch_rebalance": lambda: (to_steps(lengths, batch_rebalance_plan(
            lengths, world, share, max_steps=max_rebalance, plan_s=rebalance_s)),
            "BatchRebalanceSampler"),
        "odb_rank": lambda: (odb_loader_steps(lengths, world, share, "padded", "rank")[0], "ODBDataLoader"),
        "odb_rank_packed": lambda: (odb_loader_steps(lengths, world, share, "packed", "rank")[0], "ODBDataLoader"),
    }
    for arm, layout in (("odb_global", "padded"), ("odb_global_packed", "packed")):
        runners[arm] = _global_runner(lengths, world, share, layout, global_loader_max_world)
    for arm in arms:
        if arm in (skip or {}):
            out["arms"][arm] = {"available": True, "skipped": (skip or {})[arm]}
            continue
        if arm in GLOBAL_ARMS and not (has_step_plan() and _global_planner() is not None):
            out["arms"][arm] = {"available": False, "error": NOT_AVAILABLE}
            continue
        t0 = time.perf_counter()
        try:
            steps, source = runners[arm]()
        except Exception as err:  # noqa: BLE001 - an arm that fails is reported, the section goes on
            out["arms"][arm] = {"available": True, "error": repr(err), "wall_s": time.perf_counter() - t0}
            continue
        kept[arm] = steps
        entry = _summary(steps, g)
        entry.update(available=True, source=source, wall_s=time.perf_counter() - t0)
        if arm == "batch_rebalance" and rebalance_s:
            entry["plan_s_per_step"] = statistics.median(rebalance_s)  # the sampler's own plan, on each rank
        out["arms"][arm] = entry
    if "batch_rebalance" in kept and "odb_global" in kept:
        t0 = time.perf_counter()
        try:
            out["paired"] = paired(lengths, world, share, kept["odb_global"], max_rebalance)
            out["paired"]["wall_s"] = time.perf_counter() - t0
        except Exception as err:  # noqa: BLE001
            out["paired"] = {"error": repr(err)}
    bounds = [a["bound"] for a in out["arms"].values() if "bound" in a]
    if bounds:  # fixed's steps hold the odb arms' samples (the next s of each rank's DistributedSampler order)
        shown = out["arms"].get("fixed") if "bound" in out["arms"].get("fixed", {}) else \
            next(a for a in out["arms"].values() if "bound" in a)
        out["bound"], out["cap_bound"] = shown["bound"], shown["cap_bound"]
    return out


def paired(lengths: np.ndarray, world: int, share: int, global_steps: List[Step], max_steps: int) -> Dict[str, Any]:
    """odb global padded against BatchRebalanceSampler's plan of the same steps (``batch_rebalance_same_steps_plan``),
    step by step: the per-step DDP differences and BatchRebalance's figures on those steps."""
    same = to_steps(lengths, batch_rebalance_same_steps_plan(lengths, world, share, max_steps))
    diffs = [step_efficiency(a)["ddp"] - step_efficiency(b)["ddp"] for a, b in zip(global_steps, same)]
    return {"batch_rebalance_same_steps": _summary(same, share * world),
            "odb_global_minus_batch_rebalance": {"median": statistics.median(diffs), "min": min(diffs),
                                                 "max": max(diffs), "steps": len(diffs),
                                                 "steps_below": sum(d < -1e-9 for d in diffs)}}


def _global_runner(lengths: np.ndarray, world: int, share: int, layout: str,
                   max_world: int) -> Callable[[], Tuple[List[Step], str]]:
    def run() -> Tuple[List[Step], str]:
        if world > max_world:
            return global_direct_steps(lengths, world, share, layout), "plan_global_step (direct)"
        steps = odb_loader_steps(lengths, world, share, layout, "global")[0]
        direct = global_direct_steps(lengths, world, share, layout)
        return steps, "ODBDataLoader" + (" (= plan_global_step)" if same_steps(steps, direct)
                                         else " (differs from plan_global_step direct)")
    return run


# ---- the section -----------------------------------------------------------------------------------------
def _goal(goal: str, measured: str, target: str, met: Optional[bool]) -> Dict[str, Any]:
    return {"goal": goal, "measured": measured, "target": target, "met": met}


def _cells(w: Dict[str, Any]) -> List[Dict[str, Any]]:
    return list(w["cells"].values())


def _ddp(cell: Dict[str, Any], arm: str, key: str = "ddp") -> Optional[float]:
    a = cell["arms"].get(arm, {})
    return a[key]["median"] if key in a else None


def _where(cell: Dict[str, Any]) -> str:
    return f"{cell['world']}x{cell['share']}"


def goals(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The section's goals, met or not, with the measured figures (medians over steps per cell)."""
    out: List[Dict[str, Any]] = []
    for name, w in result["workloads"].items():
        cells = _cells(w)
        pairs = [(c, c["paired"]["odb_global_minus_batch_rebalance"]) for c in cells
                 if "odb_global_minus_batch_rebalance" in c.get("paired", {})]
        label = (f"scale {name}: odb global padded DDP step efficiency - BatchRebalanceSampler's on the same steps "
                 f"(median per cell), every world x share")
        if pairs:
            worst = min(pairs, key=lambda p: p[1]["median"])
            below = sum(p["steps_below"] for _, p in pairs)
            steps = sum(p["steps"] for _, p in pairs)
            same = worst[0]["paired"]["batch_rebalance_same_steps"]
            out.append(_goal(label, f"worst {worst[1]['median']:+.3f} (at {_where(worst[0])}; BatchRebalance "
                                    f"{same['ddp']['median']:.3f} there, over the cap in "
                                    f"{100 * same['over_cap_share']:.0f}% of its micro-batches); odb below it in "
                                    f"{below} of {steps} steps", ">= +0.000", worst[1]["median"] >= 0.0))
        else:
            out.append(_goal(label, "-", ">= +0.000", None))
        for arm, share, min_world, floor in (("odb_global", 16, 32, 0.85), ("odb_global", 4, 1, 0.70),
                                             ("odb_global_packed", 16, 1, 0.95)):
            got = [(c, _ddp(c, arm)) for c in cells if c["share"] == share and c["world"] >= min_world]
            got = [(c, v) for c, v in got if v is not None]
            where = f"{share}/rank" + (f", {min_world}+ ranks" if min_world > 1 else ", every size")
            label = f"scale {name}: {ARM_LABELS[arm]} DDP step efficiency at {where}"
            if got:
                c, v = min(got, key=lambda p: p[1])
                bound, cap_bound = c["arms"][arm]["bound"]["median"], c["arms"][arm]["cap_bound"]["median"]
                out.append(_goal(label, f"min {v:.3f} (at {_where(c)}; bound {bound:.3f}, with the cap's micro-batches "
                                        f"{cap_bound:.3f})", f">= {floor}", v >= floor))
            else:
                out.append(_goal(label, "no cell run", f">= {floor}", None))
        for arm in GLOBAL_ARMS:
            got = [(c, _ddp(c, arm, "fsdp"), _ddp(c, arm)) for c in cells]
            got = [(c, f / d) for c, f, d in got if f is not None and d]
            label = f"scale {name}: {ARM_LABELS[arm]} FSDP / DDP step efficiency"
            if got:
                c, v = min(got, key=lambda p: p[1])
                out.append(_goal(label, f"min {v:.3f} (at {_where(c)})", ">= 0.9", v >= 0.9))
            else:
                out.append(_goal(label, "no cell run", ">= 0.9", None))
    for layout, t in (result.get("planning") or {}).items():
        if not isinstance(t, dict):
            continue
        label = f"scale: plan_global_step ({layout}) CPU ms per step at {t.get('world')} x {t.get('share')}"
        if "cpu_ms_median" in t:
            out.append(_goal(label, f"{t['cpu_ms_median']:.1f} (median of {t['repeats']}; wall {t['ms_median']:.1f})",
                             f"<= {PLAN_MS_MAX:g}", t["cpu_ms_median"] <= PLAN_MS_MAX))
        else:
            out.append(_goal(label, t.get("error", NOT_AVAILABLE), f"<= {PLAN_MS_MAX:g}", None))
    return out


def run_scale(quick: bool = False, progress: Callable[..., Any] = lambda it, **kw: it,
              worlds: Optional[Sequence[int]] = None, shares: Optional[Sequence[int]] = None,
              steps: Optional[Dict[int, int]] = None, workloads: Optional[Sequence[str]] = None,
              arms: Sequence[str] = ARMS, global_loader_max_world: int = GLOBAL_LOADER_MAX_WORLD,
              plan_repeats: Optional[int] = None, seed: int = 0,
              skip: Optional[Dict[Tuple[str, int, Optional[int]], Dict[str, str]]] = None) -> Dict[str, Any]:
    """The section: every arm on every (workload, world, share) cell; plain JSON-able results.

    ``quick``: worlds 2 and 8, 4 samples per rank, 3 steps per cell (seconds). Each cell reads one epoch of
    steps x G lengths drawn from the workload (``draw``), the same lengths for every arm. ``skip``: arms left
    out per cell (default ``SKIP``).
    """
    skip = SKIP if skip is None else skip
    t_all = time.perf_counter()
    worlds = tuple(worlds or (QUICK_WORLDS if quick else WORLDS))
    shares = tuple(shares or (QUICK_SHARES if quick else SHARES))
    steps_of = {w: (steps or {}).get(w, QUICK_STEPS if quick else STEPS.get(w, 8)) for w in worlds}
    names = tuple(workloads or WORKLOADS)
    available = has_step_plan() and _global_planner() is not None
    result: Dict[str, Any] = {
        "token_budget": TOKEN_BUDGET, "micro_batch_cost": OVERHEAD, "length_range": [MIN_LENGTH, MAX_LENGTH],
        "fixed_batch_size": FIXED_B, "worlds": list(worlds), "shares": list(shares),
        "steps": {str(w): k for w, k in steps_of.items()}, "arms": list(arms), "arm_labels": ARM_LABELS,
        "global_available": available, "global_loader_max_world": global_loader_max_world,
        "workloads": {}, "planning": {}, "wall_s": {}}
    pools = {name: real_lengths(name) for name in names}
    cells = [(name, w, s) for name in names for w in worlds for s in shares]
    for name, world, share in progress(cells, desc="scale", unit="cell"):
        pool = pools[name]
        w = result["workloads"].setdefault(name, {
            "source": WORKLOAD_TEXT.get(name, name), "samples": int(len(pool)), "mean_length": float(pool.mean()),
            "share_at_max_length": float(np.mean(pool == MAX_LENGTH)), "cells": {}})
        n = steps_of[world] * share * world
        t0 = time.perf_counter()
        left_out = {**skip.get((name, world, None), {}), **skip.get((name, world, share), {})}
        cell = run_cell(draw(pool, n, seed), world, share, arms, global_loader_max_world, left_out)
        cell["steps"], cell["drawn_with_replacement"], cell["wall_s"] = steps_of[world], n > len(pool), \
            time.perf_counter() - t0
        w["cells"][f"{world}x{share}"] = cell
    t0 = time.perf_counter()
    timing_world, timing_share = PLAN_TIMING
    repeats = plan_repeats or (3 if quick else 10)
    for layout in ("padded", "packed"):
        if not available:
            result["planning"][layout] = {"world": timing_world, "share": timing_share, "error": NOT_AVAILABLE}
            continue
        try:
            result["planning"][layout] = time_global_plan(pools[names[0]], timing_world, timing_share, layout,
                                                          repeats)
        except Exception as err:  # noqa: BLE001
            result["planning"][layout] = {"world": timing_world, "share": timing_share, "error": repr(err)}
    result["wall_s"]["planning_timing"] = time.perf_counter() - t0
    from odb.bench.realdata import load_real_lengths
    from odb.bench.scale_mesh import run_mesh_section  # meshes (DP x CP) and collectives per step

    result["meshes"] = run_mesh_section(pools[names[0]], load_real_lengths(WORKLOADS[names[0]]), names[0],
                                        quick=quick)
    result["goals"] = goals(result) + result["meshes"]["goals"]
    result["notes"] = notes(result)
    result["wall_s"]["total"] = time.perf_counter() - t_all
    return result


def notes(result: Dict[str, Any]) -> List[str]:
    """What the section does, and every exception to "the same samples per step, the same cap, defaults"."""
    lo, hi = result["length_range"]
    big = max(result["worlds"])
    out = [
        f"Lengths: each real set clipped to [{lo}, {hi}]; a cell reads one epoch of steps x G lengths drawn from "
        f"it with a fixed seed (without replacement where the set holds that many, with replacement above), the "
        f"same lengths for every arm. Steps per cell: "
        + ", ".join(f"{w} ranks: {k}" for w, k in result["steps"].items()) + ".",
        f"Memory cap {result['token_budget']} padded tokens per micro-batch, overhead (micro_batch_cost) "
        f"{result['micro_batch_cost']} tokens per micro-batch. Fixed-size arms: B = min(s, "
        f"{result['fixed_batch_size']}) "
        f"(the largest whose worst case B x {hi} fits), A = s / B micro-batches per step.",
        "fixed and group_by_length are computed from the samplers' own orders (no loader: the batches are the "
        "samplers' cut in order); group_by_length is LengthGroupedSampler(B x A) over the whole set, as Trainer "
        "builds it, with a seeded generator, its batches of B dealt round-robin to the ranks as Accelerate's "
        "BatchSamplerShard deals them.",
        "BatchRebalanceSampler's own shuffle draws other steps than the DistributedSampler shares of fixed and odb: "
        "at 1 sample per rank every arm is at the bound of its steps and the arms differ only in the samples drawn. "
        "The goal against it compares the same steps: BatchRebalanceSampler(shuffle=False) over the samples of "
        "fixed's (= odb's) steps in that order, step by step (the cell's 'paired' figures).",
        "BatchRebalanceSampler at its defaults (seed 42, shuffle, drop_last=True: no partial step here, each "
        "epoch is a whole number of steps). Exception: it balances its own cost model (B x L + 0.001 B L^2) and "
        "knows no memory cap, so its micro-batches may exceed the cap (the table's note gives how often). Every "
        "rank computes the same plan of a step and yields its part; the section computes each step's plan once "
        "(rank 0's sampler, every rank's part kept; tests/bench/test_scale.py checks it equals iterating every "
        f"rank's sampler). It plans at most {REBALANCE_MAX_SAMPLES:,} samples per cell (whole steps, at least one): "
        "at G = 16,384 one step, whose plan alone takes tens of seconds (the table's note gives it).",
        "odb arms: ODBDataLoader on every rank as a thread (odb.comm.threads.ThreadRanks), DistributedSampler("
        "shuffle=True, seed=0), known lengths=, num_workers=0, collate_fn=list, global_batch_size=G, "
        f"token_budget={result['token_budget']}, micro_batch_cost={result['micro_batch_cost']}, defaults "
        "otherwise; figures from each batch's ODBStepInfo. Per-rank arms pass step_plan='rank' where the option "
        "exists.",
    ]
    if result["global_available"]:
        out.append(f"odb global arms (step_plan='global'): through ODBDataLoader up to "
                   f"{result['global_loader_max_world']} ranks (where each step also matched plan_global_step "
                   "computed directly, the table's source says so); above that, each step's plan_global_step is "
                   "computed once, as every rank of the loader computes it identically (with known lengths no "
                   "sample moves): running it through W thread ranks costs W plans per step in one process.")
    else:
        out.append(f"odb global arms: {NOT_AVAILABLE} (no step_plan option or no odb.plan.steps.global_plan).")
    left = []
    for name, w in result["workloads"].items():
        for cell in w["cells"].values():
            arms = [ARM_LABELS.get(a, a) for a, m in cell["arms"].items() if m.get("skipped")]
            if arms:
                left.append(f"{name} {cell['world']}x{cell['share']}: {', '.join(arms)}")
    if left:
        out.append("Left out (cost; the table says why): " + "; ".join(left) + ".")
    out.append("Goals: medians over a cell's steps; 'at 4/rank' is every world size, 'at 16/rank, 32+ ranks' "
               "from 32 ranks up; the figure's bound is given beside it (a goal above the bound cannot be met by any "
               "plan of those steps).")
    if big >= 1024:
        out.append("At 1,024 ranks a thread-rank loader costs seconds per step (every exchange is a 1,024-thread "
                   "barrier in one process), hence fewer steps there; each step still spans 1,024 ranks.")
    return out
