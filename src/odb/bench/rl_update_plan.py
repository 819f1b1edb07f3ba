"""The rl_update section's planning-only comparison: one RL training step of heavy-tailed rollouts on W
simulated ranks, planned by each arm under one token budget (no model, pure numpy).

A rollout row is a prompt and its completion. TRL pads a micro-batch of rows to ``rows x (longest prompt +
longest completion)`` tokens; odb runs a row's prompt and completion without the gap between them, so its
padded micro-batch costs ``rows x longest (prompt + completion)`` and a packed one its real tokens
(``odb.integrations.trl.rl_forward``); every micro-batch also costs a fixed
``overhead`` (a forward and backward pass over the weights). Figures as odb.bench.scale defines them
(``odb.bench.scale.step_efficiency``): DDP step efficiency = (real tokens / W + overhead) / max over ranks of
(the rank's padded tokens + its micro-batches x overhead).

Arms (``PLAN_ARMS``):

* ``trl``: TRL's GRPOTrainer: each rank pads its generation batch to its own longest prompt and completion,
  shuffles the rows and cuts them into equal slices of B rows, B the largest whose worst case
  (B x (max prompt + max_completion_length)) fits the budget.
* ``verl``: verl-style balancing: the step's rows partitioned into W equal-size sets of balanced token sums
  (``kk_partition``, Karmarkar-Karp largest differencing, written here from the algorithm's description),
  set r to rank r (rows move between ranks); then each rank's rows into M micro-batches of balanced token sums,
  M the largest number any rank needs (ceil of its tokens / budget), raised until every micro-batch of every
  rank fits the budget; packed (a micro-batch costs its real tokens).
* ``odb_rollout`` / ``odb_rollout_packed``: what ``odb.integrations.trl.enable_odb`` runs (``layout="padded"``
  / ``"packed"``) with ``step_plan="rank"`` (the default's choice on one process):
  ``odb.plan.rollouts.per_rank.plan_rollout_steps`` over every rank's rows (rows stay on their rank, the same row
  count per micro-step on every rank).
* ``odb_global`` / ``odb_global_packed``: what ``enable_odb`` runs on several ranks with ``step_plan="auto"``
  for every loss_type, the entropy bonus too (each row weighted by its own slice's normaliser):
  ``odb.plan.rollouts.across_ranks.plan_rollout_global`` (``odb.plan.steps.global_plan.plan_global_step`` over all ranks'
  rows, each row's prompt + completion as one length, then no empty micro-batch, rows kept home where it costs
  nothing, the rank-local plan where it costs no more), which moves rows between ranks.

Example:
    >>> kk_partition([8, 7, 6, 5, 4], 2)        # sums 14 and 16: LDM's answer (15 / 15 exists)
    [[0, 2], [1, 3, 4]]
    >>> kk_partition([9, 1, 1, 1], 2), kk_partition([9, 1, 1, 1], 2, equal_size=True)   # equal_size: 2 rows each
    ([[0], [1, 2, 3]], [[0, 3], [1, 2]])
"""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from odb.bench.scale import MicroBatch, step_efficiency

PLAN_ARMS = ("trl", "verl", "odb_rollout", "odb_rollout_packed", "odb_global", "odb_global_packed")
PLAN_ARM_LABELS = {"trl": "TRL equal slices", "verl": "verl-style KK balance (packed)",
                   "odb_rollout": "odb rollout plan (padded)", "odb_rollout_packed": "odb rollout plan (packed)",
                   "odb_global": "odb global (padded)", "odb_global_packed": "odb global (packed)"}
MOVES_ROWS = {"trl": False, "verl": True, "odb_rollout": False, "odb_rollout_packed": False, "odb_global": True,
              "odb_global_packed": True}
PLANNED_ONLY: Tuple[str, ...] = ()  # arms that are not what a trainer runs (none: odb's global plan is the trainer's)

Rows = Tuple[np.ndarray, np.ndarray]  # (prompt lengths, completion lengths), each (world, rows)


# ---- rollout lengths --------------------------------------------------------------------------------------
def draw_rollouts(world: int, rows: int, generations: int, prompt: Sequence[float], completion: Sequence[float],
                  seed: int = 0) -> Rows:
    """Every rank's rows of one generation batch: ``rows / generations`` prompts per rank, each sampled
    ``generations`` times (a GRPO group shares its prompt). Lengths are log-normal: ``prompt`` = (median,
    sigma, min, max), ``completion`` = (median, sigma, max_completion_length), clipped to [1, max] (a heavy
    tail piles up at max_completion_length, as truncated generations do).

    Example:
        >>> p, c = draw_rollouts(2, 8, 4, (40, 0.5, 8, 96), (60, 1.0, 256), seed=1)
        >>> p.shape, bool((p[:, :4] == p[:, :1]).all()), int(c.max()) <= 256
        ((2, 8), True, True)
    """
    if rows % generations:
        raise ValueError(f"rl_update: {rows} rows per rank is no multiple of num_generations={generations}.")
    rng = np.random.default_rng(seed)
    p_med, p_sigma, p_lo, p_hi = prompt
    c_med, c_sigma, c_hi = completion
    prompts = np.clip(np.rint(rng.lognormal(math.log(p_med), p_sigma, (world, rows // generations))), p_lo, p_hi)
    completions = np.clip(np.rint(rng.lognormal(math.log(c_med), c_sigma, (world, rows))), 1, c_hi)
    return np.repeat(prompts, generations, axis=1).astype(np.int64), completions.astype(np.int64)


def padding_share(batches: Sequence[Optional[MicroBatch]]) -> float:
    """1 - real tokens / padded tokens processed.

    Example:
        >>> padding_share([MicroBatch(10, 5, 5), MicroBatch(10, 10, 10)])
        0.25
    """
    padded = sum(m.padded for m in batches if m is not None)
    return 1.0 - sum(m.real for m in batches if m is not None) / padded if padded else 0.0


# ---- Karmarkar-Karp ---------------------------------------------------------------------------------------
def kk_partition(weights: Sequence[float], k: int, equal_size: bool = False) -> List[List[int]]:
    """Indices of ``weights`` in ``k`` sets of near-equal sums: Karmarkar-Karp's largest differencing method.

    Each partial solution is k sets with their sums; the method repeatedly takes the two partial solutions
    whose largest and smallest sums differ most and merges them, the heaviest set of one with the lightest of
    the other, until one is left. Plain: every item starts as its own partial solution (itself and k - 1
    empty sets). ``equal_size`` (balanced LDM): the items, heaviest first, start in groups of k, one item per
    set, so every merge adds one item to each set and the sets' sizes differ by at most one. Sets come out
    sorted by their smallest index; deterministic (ties by the order of creation).

    Example:
        >>> kk_partition([4, 5, 6, 7, 8], 2)
        [[0, 1, 3], [2, 4]]
        >>> sorted(len(s) for s in kk_partition(list(range(10)), 3, equal_size=True))
        [3, 3, 4]
    """
    if k < 1:
        raise ValueError(f"kk_partition: k={k} sets, at least 1.")
    w = [float(x) for x in weights]
    order = sorted(range(len(w)), key=lambda i: (-w[i], i))
    groups = [order[j:j + k] for j in range(0, len(order), k)] if equal_size else [[i] for i in order]
    counter = itertools.count()
    heap: List[Tuple[float, int, List[Tuple[float, List[int]]]]] = []
    for group in groups:
        sets = [(w[i], [i]) for i in group] + [(0.0, []) for _ in range(k - len(group))]
        sets.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), next(counter), sets))
    if not heap:
        return [[] for _ in range(k)]
    while len(heap) > 1:
        a = heapq.heappop(heap)[2]  # both sorted heaviest first: a's heaviest meets b's lightest
        b = heapq.heappop(heap)[2]
        merged = [(sa + sb, ia + ib) for (sa, ia), (sb, ib) in zip(a, reversed(b))]
        merged.sort(key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), next(counter), merged))
    out = [sorted(items) for _, items in heap[0][2]]
    return sorted(out, key=lambda s: (s[0] if s else len(w), len(s)))


# ---- one step, every arm ----------------------------------------------------------------------------------
def _mb(prompt: np.ndarray, completion: np.ndarray, idx: Sequence[int], layout: str) -> Optional[MicroBatch]:
    """The micro-batch of rows ``idx`` (flat indices) as ``layout`` runs it: ``"trl"`` rows x (longest prompt +
    longest completion), ``"padded"`` rows x longest (prompt + completion), ``"packed"`` its real tokens; None
    for a ghost."""
    if len(idx) == 0:
        return None
    i = np.asarray(idx, dtype=np.int64)
    p, c = prompt[i], completion[i]
    real = int(p.sum() + c.sum())
    padded = {"trl": len(i) * int(p.max() + c.max()), "padded": len(i) * int((p + c).max()), "packed": real}[layout]
    return MicroBatch(padded, real, int((p + c).max()))


Planned = Tuple[List[List[Optional[MicroBatch]]], float, float]  # (step, rows moved share, planning seconds)


def trl_slices(rows: Rows, slice_rows: int, seed: int = 0) -> Planned:
    """TRL's slices: each rank's generation batch padded to its own widths, shuffled, cut every ``slice_rows``
    (planning seconds: one rank's shuffle and cut)."""
    prompt, completion = rows
    world, n = prompt.shape
    if n % slice_rows:
        raise ValueError(f"rl_update: {n} rows per rank is no multiple of TRL's per_device_train_batch_size="
                         f"{slice_rows}.")
    rng = np.random.default_rng(seed)
    out, plan_s = [], 0.0
    for r in range(world):
        t0 = time.perf_counter()
        width = int(prompt[r].max() + completion[r].max())
        perm = rng.permutation(n)
        cuts = [perm[j:j + slice_rows] for j in range(0, n, slice_rows)]
        plan_s += time.perf_counter() - t0
        out.append([MicroBatch(slice_rows * width, int(prompt[r, s].sum() + completion[r, s].sum()),
                               int((prompt[r, s] + completion[r, s]).max())) for s in cuts])
    return out, 0.0, plan_s / world


def verl_plan(rows: Rows, budget: int) -> Planned:
    """verl-style: the step's rows balanced over ranks (equal-size KK on row tokens), then each rank's into the
    same number M of micro-batches (KK on row tokens), packed. Planning seconds: the balance (computed once
    for the step) plus a rank's own split (the mean over ranks: they split at once, each its own rows)."""
    prompt, completion = rows
    world, n = prompt.shape
    p, c = prompt.ravel(), completion.ravel()
    tokens = p + c
    t0 = time.perf_counter()
    sets = kk_partition(tokens.tolist(), world, equal_size=True)
    balance_s = time.perf_counter() - t0
    moved = sum(int(i) // n != r for r, s in enumerate(sets) for i in s) / max(len(tokens), 1)
    t0 = time.perf_counter()
    m = max(math.ceil(int(tokens[s].sum()) / budget) for s in sets)  # each rank's own count; the ranks agree on the max
    while True:
        parts = [[[s[j] for j in part] for part in kk_partition(tokens[s].tolist(), m)] for s in sets]
        if all(int(tokens[part].sum()) <= budget for rank in parts for part in rank):
            break
        m += 1
    split_s = (time.perf_counter() - t0) / world
    return [[_mb(p, c, part, "packed") for part in rank] for rank in parts], moved, balance_s + split_s


def odb_rollout(rows: Rows, budget: int, packed: bool = False) -> Planned:
    """odb's rollout plan: every rank computes it from every rank's lengths; rows stay on their rank."""
    from odb.plan.rollouts.per_rank import plan_rollout_steps

    prompt, completion = rows
    world, n = prompt.shape
    layout = "packed" if packed else "padded"
    t0 = time.perf_counter()
    plan = plan_rollout_steps(prompt, completion, budget, layout=layout)
    plan_s = time.perf_counter() - t0
    return [[_mb(prompt[r], completion[r], plan.rows(r, s), layout) for s in range(plan.steps)]
            for r in range(world)], 0.0, plan_s


def odb_global(rows: Rows, budget: int, packed: bool, micro_batch_cost: Optional[float] = None) -> Planned:
    """odb's global rollout plan (``plan_rollout_global``, what the trainer runs with ``step_plan="global"``, at its
    default ``micro_batch_cost`` unless given): every rank computes it from every rank's lengths; rows move between
    ranks."""
    from odb.plan.rollouts.across_ranks import plan_rollout_global

    prompt, completion = rows
    p, c = prompt.ravel(), completion.ravel()
    layout = "packed" if packed else "padded"
    t0 = time.perf_counter()
    plan = plan_rollout_global(prompt, completion, budget, micro_batch_cost=micro_batch_cost, layout=layout)
    plan_s = time.perf_counter() - t0
    moved = plan.moved_rows / max(len(p), 1)
    return [[_mb(p, c, g, layout) for g in groups] for groups in plan.ranks], moved, plan_s


def plan_step(rows: Rows, arm: str, budget: int, overhead: float, slice_rows: int, seed: int = 0
              ) -> Dict[str, Any]:
    """One arm's plan of one step: its figures (planning milliseconds: what one rank computes)."""
    if arm == "trl":
        step, moved, plan_s = trl_slices(rows, slice_rows, seed)
    elif arm == "verl":
        step, moved, plan_s = verl_plan(rows, budget)
    elif arm in ("odb_rollout", "odb_rollout_packed"):
        step, moved, plan_s = odb_rollout(rows, budget, packed=arm == "odb_rollout_packed")
    elif arm in ("odb_global", "odb_global_packed"):
        step, moved, plan_s = odb_global(rows, budget, packed=arm == "odb_global_packed")
    else:
        raise ValueError(f"rl_update: unknown planning arm {arm!r}; known: {PLAN_ARMS}")
    flat = [m for rank in step for m in rank]
    eff = step_efficiency(step, overhead=overhead, cap=budget)
    return {"ddp": eff["ddp"], "fsdp": eff["fsdp"], "bound": eff["bound"], "micro_steps": max(len(r) for r in step),
            "padding_share": padding_share(flat), "max_micro_batch_tokens": max(m.padded for m in flat if m),
            "moved": moved, "plan_ms": 1e3 * plan_s,
            "real": sum(m.real for m in flat if m)}


def _spread(values: Sequence[float]) -> Dict[str, float]:
    return {"median": float(statistics.median(values)), "min": float(min(values)), "max": float(max(values))}


def run_planning(worlds: Sequence[int], steps: Dict[int, int], rows: int, generations: int,
                 prompt: Sequence[float], completion: Sequence[float], budget: int, overhead: float,
                 slice_rows: int, arms: Sequence[str] = PLAN_ARMS, seed: int = 0,
                 progress: Callable[..., Any] = lambda it, **kw: it) -> Dict[str, Any]:
    """Every arm on ``steps[W]`` steps at each world size W (the same rows for every arm); per arm the
    median (min-max) over steps of each figure."""
    out: Dict[str, Any] = {}
    cells = [(w, k) for w in worlds for k in range(steps[w])]
    got: Dict[int, Dict[str, List[Dict[str, Any]]]] = {w: {a: [] for a in arms} for w in worlds}
    for world, k in progress(cells, desc="rl_update planning", unit="step"):
        step_rows = draw_rollouts(world, rows, generations, prompt, completion, seed=seed + 1000 * world + k)
        real = int(step_rows[0].sum() + step_rows[1].sum())
        for arm in arms:
            fig = plan_step(step_rows, arm, budget, overhead, slice_rows, seed=k)
            if fig["real"] != real:
                raise RuntimeError(f"rl_update: {arm} planned {fig['real']} real tokens of the step's {real}")
            got[world][arm].append(fig)
    for world in worlds:
        out[str(world)] = {"world": world, "steps": steps[world], "arms": {
            arm: {key: _spread([f[key] for f in figs]) for key in ("ddp", "fsdp", "bound", "micro_steps",
                                                                   "padding_share", "max_micro_batch_tokens",
                                                                   "moved", "plan_ms")}
            for arm, figs in got[world].items()}}
    return out
