"""One training step of rollouts planned over all ranks, rows moving between them (pure numpy).

``odb.plan.rollouts.per_rank`` keeps every rank's rows on their rank, so a rank holding long
rollouts is the slowest. ``plan_rollout_global`` assigns every row of the step (flat index
``rank * n + i``: row i of rank ``rank``'s slice of n rows) to one rank and one micro-step:

1. ``odb.plan.steps.global_plan.plan_global_step`` over all ranks' rows, a row's length its prompt
   plus its completion (odb's layouts run a row without the gap between them), ``layout``
   ``"padded"`` (a micro-batch costs rows x its longest row, rounded up to
   ``pad_to_multiple_of``) or ``"packed"`` (the sum of its rows), under ``token_budget``, each
   micro-batch also costing ``micro_batch_cost`` (default: a sixteenth of the budget, as
   ``plan_rollout_steps``). Every rank runs the same number M of micro-steps.
2. No empty micro-batch: TRL's loss cannot run on zero rows, and every rank must call it at
   every micro-step (it holds collectives). A rank with an empty micro-step splits its
   costliest micro-batch of two or more rows (its rows longest first, at the cut of least
   total cost: a part never costs more than the whole, so the budget holds); a rank with no
   such micro-batch left (fewer rows than M) takes the shortest row of the costliest
   micro-batch of two or more rows of the costliest rank that holds more than M rows (one
   row alone fits the budget). When the step has fewer rows per rank than M (n < M, which
   ``plan_global_step`` may choose when few long rows balance better with a ghost), empty
   micro-batches cannot be avoided: the plan is then the rank-local one
   (``plan_rollout_steps``: rows stay, ``GlobalRolloutPlan.local`` is True).
3. Rows stay home where it costs nothing: the ranks' row sets are interchangeable (every
   rank runs M micro-steps), so plan rank k's rows go to the rank holding most of them
   (greedy on the counts, largest first): fewer bytes moved, the same step. And the
   rank-local plan is taken whenever its slowest rank (its tokens plus ``micro_batch_cost``
   per micro-step) costs no more than the moved plan's: rows move only to gain.

Same lengths, same plan: every rank computes it from every rank's lengths.

Example:
    >>> import numpy as np
    >>> prompt = np.array([[2, 2, 2, 2], [2, 2, 2, 2]])
    >>> completion = np.array([[30, 30, 30, 30], [2, 2, 2, 2]])   # rank 0 holds the long rollouts
    >>> plan = plan_rollout_global(prompt, completion, token_budget=64)
    >>> [[g.tolist() for g in groups] for groups in plan.ranks], plan.costs.tolist()   # 2 long, 2 short each
    ([[[0, 1], [4, 5]], [[2, 3], [6, 7]]], [[64, 8], [64, 8]])
    >>> plan.moved_rows, plan.sent(0, 1).tolist(), plan.local
    (4, [2, 3], False)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.steps.global_plan import plan_global_step
from odb.plan.steps.step_plan import OptimizerStepPlan
from odb.plan.rollouts.per_rank import RolloutPlan, check_rollout_lengths, padded_width, plan_rollout_steps

__all__ = ["GlobalRolloutPlan", "plan_rollout_global"]

Groups = List[List[np.ndarray]]


@dataclass(frozen=True)
class GlobalRolloutPlan(OptimizerStepPlan):
    """Micro-steps of one training step on every rank, rows moving between ranks (``OptimizerStepPlan`` over
    the step's rows, every rank's slice together).

    ``ranks[r][s]``: the flat rows (``origin rank * n + row``, ascending) rank r trains at micro-step s,
    never empty; every rank has ``steps`` of them. ``widths[r, s]``: (prompt, completion) widths of that
    micro-batch (its longest of each, at least 1); ``costs[r, s]``: the tokens its layout runs. ``n``: rows
    per rank in the step. ``local``: True when the rank-local plan was taken (rows stay).
    """

    widths: np.ndarray
    costs: np.ndarray
    n: int
    local: bool = False

    @property
    def steps(self) -> int:
        """Micro-steps (forward and backward passes) of the step, on every rank."""
        return self.micro_steps

    def rows(self, rank: int, step: int) -> np.ndarray:
        """Rank ``rank``'s flat rows of micro-step ``step``."""
        return self.ranks[rank][step]

    def sent(self, source: int, target: int) -> np.ndarray:
        """Rows of ``source``'s slice (indices into it, ascending) that rank ``target`` trains."""
        rows = self.samples_of(target)
        return np.sort(rows[rows // max(self.n, 1) == source] - source * self.n)

    @property
    def moved_rows(self) -> int:
        """Rows trained on another rank than their own, over all ranks."""
        return self.moved(np.arange(self.world * self.n) // max(self.n, 1))


def _row_tokens(prompt: np.ndarray, completion: np.ndarray, layout: str, multiple: int) -> np.ndarray:
    """What one row alone costs: its tokens (packed) or its width rounded up (padded); same shape."""
    return prompt + completion if layout == "packed" else padded_width(prompt + completion, multiple)


def _refuse_oversize(prompt: np.ndarray, completion: np.ndarray, tokens: np.ndarray, budget: int,
                     multiple: int) -> None:
    """Raise naming the costliest row when a row alone exceeds the budget (as ``plan_rollout_steps`` does)."""
    if tokens.size == 0 or int(tokens.max()) <= budget:
        return
    r, row = (int(x) for x in np.unravel_index(int(np.argmax(tokens)), tokens.shape))
    raise ValueError(f"odb rank {r}: rollout row {row} alone costs {int(tokens[r, row])} padded tokens (a prompt "
                     f"of {int(prompt[r, row])} and a completion of {int(completion[r, row])} tokens, widths "
                     f"rounded to pad_to_multiple_of={multiple}), over token_budget={budget}. Rule: a "
                     f"micro-batch holds at least one row and stays within the budget. Fix: raise "
                     f"token_budget to at least the longest prompt plus max_completion_length.")


def group_cost(tokens: np.ndarray, layout: str) -> int:
    """The tokens a micro-batch of rows costing ``tokens`` alone runs: rows x the costliest (padded), the sum
    (packed); 0 for none.

    Example:
        >>> group_cost(np.array([8, 4, 4]), "padded"), group_cost(np.array([8, 4, 4]), "packed")
        (24, 16)
    """
    if len(tokens) == 0:
        return 0
    return int(tokens.sum()) if layout == "packed" else len(tokens) * int(tokens.max())


def split_group(group: np.ndarray, tokens: np.ndarray, layout: str) -> Tuple[np.ndarray, np.ndarray]:
    """``group`` (two rows or more) in two non-empty parts: its rows longest first, cut where the parts' total
    cost is least, then their larger one least (ties: the first such cut); each part sorted.

    Example:
        >>> [p.tolist() for p in split_group(np.array([3, 4, 5, 6]), np.array([1, 1, 1, 9, 2, 2, 9]), "padded")]
        [[3, 6], [4, 5]]
    """
    order = group[np.lexsort((group, -tokens[group]))]
    best, cut = None, 1
    for k in range(1, len(order)):
        a, b = group_cost(tokens[order[:k]], layout), group_cost(tokens[order[k:]], layout)
        key = (a + b, max(a, b))
        if best is None or key < best:
            best, cut = key, k
    return np.sort(order[:cut]), np.sort(order[cut:])


def _costliest_multi(groups: List[np.ndarray], tokens: np.ndarray, layout: str) -> Optional[int]:
    """The slot of the costliest micro-batch of two rows or more (the first of equals), None without one."""
    slots = [(-group_cost(tokens[g], layout), s) for s, g in enumerate(groups) if len(g) >= 2]
    return min(slots)[1] if slots else None


def fill_empty(groups: Groups, tokens: np.ndarray, layout: str) -> bool:
    """Fill every empty micro-batch in place (the module docstring says how); False when a rank would still
    have one (the step has fewer rows than cells).

    Example:
        >>> g = [[np.array([0, 1, 2]), np.array([], dtype=np.int64)], [np.array([3]), np.array([4])]]
        >>> fill_empty(g, np.array([5, 3, 3, 9, 9]), "padded"), [[x.tolist() for x in r] for r in g]
        (True, [[[0], [1, 2]], [[3], [4]]])
    """
    steps = len(groups[0]) if groups else 0
    for rank in groups:  # split the rank's own costliest micro-batch while it has an empty one
        for s in range(steps):
            if len(rank[s]) == 0:
                slot = _costliest_multi(rank, tokens, layout)
                if slot is None:
                    break
                rank[slot], rank[s] = split_group(rank[slot], tokens, layout)
    while True:  # a rank with fewer rows than micro-steps takes a row from a rank with more
        empty = [(r, s) for r, rank in enumerate(groups) for s in range(steps) if len(rank[s]) == 0]
        if not empty:
            return True
        donors = [(-sum(group_cost(tokens[g], layout) for g in rank), d) for d, rank in enumerate(groups)
                  if sum(len(g) for g in rank) > steps]
        if not donors:
            return False
        d = min(donors)[1]
        slot = _costliest_multi(groups[d], tokens, layout)
        if slot is None:  # a donor with more rows than slots and no empty one always has such a micro-batch
            return False
        g = groups[d][slot]
        row = g[np.lexsort((-g, tokens[g]))[0]]  # the shortest (the last of equals)
        groups[d][slot] = g[g != row]
        r, s = empty[0]
        groups[r][s] = np.array([row], dtype=np.int64)


def group_costs(groups: Groups, tokens: np.ndarray, layout: str) -> np.ndarray:
    """(world, micro-steps) ``group_cost`` of every micro-batch.

    Example:
        >>> group_costs([[np.array([0, 1])], [np.array([2])]], np.array([4, 2, 9]), "padded").tolist()
        [[8], [9]]
    """
    return np.array([[group_cost(tokens[g], layout) for g in rank] for rank in groups],
                    dtype=np.int64).reshape(len(groups), -1)


def slowest(costs: np.ndarray, overhead: float) -> float:
    """The slowest rank's cost: its micro-batches' tokens (``costs``, world x micro-steps) plus ``overhead`` per
    micro-batch.

    Example:
        >>> slowest(np.array([[8], [9]]), 1.0)
        10.0
    """
    return float((costs.sum(axis=1) + overhead * costs.shape[1]).max()) if costs.size else 0.0


def keep_home(groups: Groups, n: int) -> Groups:
    """The ranks' row sets reassigned so each goes where most of its rows are (greedy on the counts, largest
    first, ties to the lower plan rank, then the lower rank): the same micro-steps, fewer rows moved.

    Example:
        >>> g = [[np.array([2, 3])], [np.array([0, 1])]]   # n=2: plan rank 0 holds rank 1's rows
        >>> [[x.tolist() for x in r] for r in keep_home(g, 2)]
        [[[0, 1]], [[2, 3]]]
    """
    world = len(groups)
    counts = np.zeros((world, world), dtype=np.int64)  # counts[k, r]: plan rank k's rows from rank r
    for k, rank in enumerate(groups):
        rows = np.concatenate(rank) if rank else np.zeros(0, dtype=np.int64)
        counts[k] = np.bincount(rows // max(n, 1), minlength=world)[:world]
    cells = np.flatnonzero(counts.ravel())
    target = np.full(world, -1)
    taken = np.zeros(world, dtype=bool)
    for cell in cells[np.lexsort((cells, -counts.ravel()[cells]))]:  # the counts above 0, largest first
        k, r = divmod(int(cell), world)
        if target[k] < 0 and not taken[r]:
            target[k], taken[r] = r, True
    target[target < 0] = np.flatnonzero(~taken)  # plan ranks without a row of a free rank: in order
    out: Groups = [[] for _ in range(world)]
    for k in range(world):
        out[int(target[k])] = groups[k]
    return out


def _local(prompt: np.ndarray, completion: np.ndarray, plan: RolloutPlan) -> Groups:
    """The rank-local plan's micro-batches as flat rows."""
    world, n = prompt.shape
    return [[np.sort(plan.rows(r, s)) + r * n for s in range(plan.steps)] for r in range(world)]


def plan_rollout_global(prompt_lengths: np.ndarray, completion_lengths: np.ndarray, token_budget: int,
                        pad_to_multiple_of: int = 1, micro_batch_cost: Optional[float] = None,
                        layout: str = "padded") -> GlobalRolloutPlan:
    """Assign every rank's rows to a rank and a micro-step (the module docstring says how): the same number of
    micro-steps on every rank, every micro-batch within ``token_budget`` and not empty.

    ``prompt_lengths``, ``completion_lengths``: (world, rows) token counts, as for
    ``odb.plan.rollouts.per_rank.plan_rollout_steps`` (and the same ``ValueError`` for a row that alone exceeds the
    budget).

    Example:
        >>> plan = plan_rollout_global(np.array([[1, 1, 1], [1, 1, 1]]), np.array([[9, 9, 9], [9, 9, 9]]), 100)
        >>> plan.steps, plan.moved_rows   # alike ranks: every row stays
        (1, 0)
        >>> plan.local   # the rank-local plan costs no more: taken
        True
        >>> skewed = plan_rollout_global(np.array([[1, 1], [1, 1]]), np.array([[40, 40], [2, 2]]), 100)
        >>> skewed.local, [[g.tolist() for g in groups] for groups in skewed.ranks], skewed.costs.tolist()
        (False, [[[0], [2]], [[1], [3]]], [[41, 3], [41, 3]])
    """
    prompt = np.asarray(prompt_lengths, dtype=np.int64)
    completion = np.asarray(completion_lengths, dtype=np.int64)
    check_rollout_lengths(prompt, completion, layout, "plan_rollout_global")
    budget, multiple = int(token_budget), int(pad_to_multiple_of or 1)
    overhead = budget / 16 if micro_batch_cost is None else float(micro_batch_cost)
    world, n = prompt.shape
    tokens = _row_tokens(prompt, completion, layout, multiple)
    _refuse_oversize(prompt, completion, tokens, budget, multiple)
    flat_tokens = tokens.ravel()
    if n == 0:
        return GlobalRolloutPlan([[] for _ in range(world)], np.zeros((world, 0, 2), dtype=np.int64),
                                 np.zeros((world, 0), dtype=np.int64), 0)
    cost = CostModel((budget,), pad_to_multiple_of=multiple if layout == "padded" else 1, layout=layout)
    planned = plan_global_step(np.maximum(prompt + completion, 1).ravel(), world, cost, overhead)
    groups: Groups = [[np.sort(np.asarray(g, dtype=np.int64)) for g in rank] for rank in planned.ranks]
    rank_plan = plan_rollout_steps(prompt, completion, budget, multiple, overhead, layout)
    local = len(planned.oversize) > 0 or not fill_empty(groups, flat_tokens, layout)
    costs = group_costs(groups, flat_tokens, layout)
    if local or slowest(rank_plan.costs, overhead) <= slowest(costs, overhead):  # rows move only to gain
        return GlobalRolloutPlan(_local(prompt, completion, rank_plan), rank_plan.widths, rank_plan.costs, n, True)
    groups = keep_home(groups, n)
    p_flat, c_flat = np.maximum(prompt, 1).ravel(), np.maximum(completion, 1).ravel()
    widths = np.array([[[int(p_flat[g].max()), int(c_flat[g].max())] for g in rank] for rank in groups],
                      dtype=np.int64).reshape(world, -1, 2)
    return GlobalRolloutPlan(groups, widths, group_costs(groups, flat_tokens, layout), n, False)
