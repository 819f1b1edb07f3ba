"""One training step of rollouts (an RL trainer's slice of a generation batch) cut into micro-steps by tokens.

Each rank holds the same number of rollout rows (a prompt and its completion). A micro-batch
runs its rows' real tokens laid out as ``layout``: ``"padded"`` rows, each from its first
token, right-padded to the micro-batch's longest prompt plus completion, cost
``rows x longest`` tokens (rounded up to ``pad_to_multiple_of``); ``"packed"`` rows, one
row of every rollout's tokens, cost their sum (``odb.integrations.trl.rl_forward``). The
micro-batch's tensors are also trimmed to its longest prompt and longest completion
(``widths``). The plan is one answer for all ranks, computed by each from every
rank's lengths: micro-step ``s`` takes the next ``sizes[s]`` rows of every rank (each rank's
rows sorted longest first), cut where the sum of the costliest rank's padded tokens plus a
fixed cost per micro-step is least, every micro-batch within the budget. So every rank runs the same number of micro-steps (DDP all-reduces at each synced
backward) with the same number of rows in each (the RL trainers gather per-row metrics at
every loss call, and a collective of unequal shapes fails), and no rank needs a ghost.

Pure numpy: integers in, plan out.

Example:
    >>> import numpy as np
    >>> plan = plan_rollout_steps(np.array([[3, 3, 2, 2]]), np.array([[9, 1, 2, 5]]), token_budget=16)
    >>> plan.sizes, [plan.rows(0, s).tolist() for s in range(plan.steps)]
    ((1, 1, 2), [[0], [3], [1, 2]])
    >>> plan.costs.tolist()   # rows 3, 1 and 2 together would cost 3 x 7 = 21: over the budget
    [[12, 7, 8]]
    >>> plan_rollout_steps(np.array([[3, 3, 2, 2]]), np.array([[9, 1, 2, 5]]), 16, layout="packed").costs.tolist()
    [[12, 15]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np

from odb.plan.steps.step_plan import OptimizerStepPlan

__all__ = ["ROLLOUT_LAYOUTS", "RolloutPlan", "check_rollout_lengths", "plan_rollout_steps", "padded_width"]

ROLLOUT_LAYOUTS = ("padded", "packed")


def padded_width(length: np.ndarray, multiple: int) -> np.ndarray:
    """``length`` rounded up to a multiple of ``multiple``, at least one token (a micro-batch keeps one column).

    Example:
        >>> padded_width(np.array([0, 5, 8]), 4).tolist()
        [4, 8, 8]
    """
    length = np.maximum(np.asarray(length, dtype=np.int64), 1)
    return -(-length // multiple) * multiple


@dataclass(frozen=True)
class RolloutPlan(OptimizerStepPlan):
    """Micro-steps of one training step on every rank, each rank's rows staying there (``OptimizerStepPlan``
    over the step's rows, every rank's slice together: ``ranks[r][s]`` rank r's rows of micro-step s as flat rows
    ``r * n + row``; ``of`` builds it).

    ``order[r]``: rank r's rows, longest first; ``sizes[s]``: rows of micro-step s (the same on
    every rank); ``widths[r, s]``: (prompt, completion) widths of rank r's micro-batch s (its
    longest of each); ``costs[r, s]``: the tokens its layout runs.
    """

    order: np.ndarray
    sizes: Tuple[int, ...]
    widths: np.ndarray
    costs: np.ndarray

    @property
    def steps(self) -> int:
        """Micro-steps (forward and backward passes) of the step, on every rank."""
        return len(self.sizes)

    def rows(self, rank: int, step: int) -> np.ndarray:
        """Rank ``rank``'s rows (indices into its slice) of micro-step ``step``."""
        start = int(sum(self.sizes[:step]))
        return self.order[rank, start:start + self.sizes[step]]

    @classmethod
    def of(cls, order: np.ndarray, sizes: Tuple[int, ...], widths: np.ndarray, costs: np.ndarray) -> "RolloutPlan":
        """The plan of these rows (``ranks`` made from ``order`` and ``sizes``)."""
        world, n = order.shape
        bounds = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
        ranks = [[order[r, bounds[s]:bounds[s + 1]] + r * n for s in range(len(sizes))] for r in range(world)]
        return cls(ranks, order, tuple(sizes), widths, costs)


def check_rollout_lengths(prompt: np.ndarray, completion: np.ndarray, layout: str, who: str) -> None:
    """Refuse lengths that are not (world, rows) arrays of one shape, or an unknown layout, naming ``who``.

    Example:
        >>> check_rollout_lengths(np.zeros((2, 3)), np.zeros((2, 3)), "packed", "plan")
    """
    if prompt.ndim != 2 or prompt.shape != completion.shape:
        raise ValueError(f"{who} got prompt lengths of shape {prompt.shape} and completion lengths of shape "
                         f"{completion.shape}. Rule: both are (world, rows), the same shape. Fix: pass every "
                         f"rank's lengths, one row of the array per rank.")
    if layout not in ROLLOUT_LAYOUTS:
        raise ValueError(f"{who} got layout={layout!r}. Rule: one of {ROLLOUT_LAYOUTS}. Fix: pass "
                         f"layout='padded' or layout='packed'.")


def plan_rollout_steps(prompt_lengths: np.ndarray, completion_lengths: np.ndarray, token_budget: int,
                       pad_to_multiple_of: int = 1, micro_batch_cost: Optional[float] = None,
                       layout: str = "padded") -> RolloutPlan:
    """Cut every rank's rows into micro-steps of least total cost, each within ``token_budget`` on every rank.

    ``prompt_lengths``, ``completion_lengths``: (world, rows) token counts (a row's prompt
    tokens from its first to its last; its completion tokens up to the last one trained).
    Every rank's rows are sorted longest first and micro-step ``s`` takes the same number of
    rows on every rank; the cut points minimise the sum over micro-steps of the costliest
    rank's tokens (``layout``: see the module docstring) plus ``micro_batch_cost`` per micro-step (default: a sixteenth of the
    budget, a forward and backward pass over the weights), by a shortest path over the cut
    points. Fewer, fuller micro-batches where the rows are alike; a long row's micro-batch
    stops before it pads many short ones. Raises ``ValueError`` for a row that alone exceeds
    the budget.

    Example:
        >>> plan = plan_rollout_steps(np.array([[4, 4], [2, 2]]), np.array([[4, 4], [1, 9]]), token_budget=16)
        >>> plan.sizes, plan.costs.tolist()   # rank 0's two rows would fit one micro-batch; rank 1's would not
        ((1, 1), [[8, 8], [11, 3]])
        >>> plan_rollout_steps(np.array([[4, 4], [2, 2]]), np.array([[4, 4], [1, 9]]), 16, layout="packed").sizes
        (2,)
        >>> plan_rollout_steps(np.array([[1, 1, 1, 1]]), np.array([[15, 1, 1, 1]]), token_budget=64).sizes
        (1, 3)
    """
    prompt = np.asarray(prompt_lengths, dtype=np.int64)
    completion = np.asarray(completion_lengths, dtype=np.int64)
    check_rollout_lengths(prompt, completion, layout, "plan_rollout_steps")
    budget, multiple = int(token_budget), int(pad_to_multiple_of or 1)
    overhead = budget / 16 if micro_batch_cost is None else float(micro_batch_cost)
    # a row's tokens as its layout runs them: its real ones (packed) or its width, rounded (padded)
    tokens = prompt + completion if layout == "packed" else padded_width(prompt + completion, multiple)
    world, n = prompt.shape
    # Longest first; ties by row index, so every rank computes the same order.
    order = np.stack([np.lexsort((np.arange(n), -tokens[r])) for r in range(world)]) if n else \
        np.zeros((world, 0), dtype=np.int64)
    sp = np.take_along_axis(np.maximum(prompt, 1), order, axis=1)
    sc = np.take_along_axis(np.maximum(completion, 1), order, axis=1)
    sr = np.take_along_axis(tokens, order, axis=1)
    # runs[i]: (costs (world, fits), widths) of the micro-steps starting at sorted row i and taking 1..fits rows
    runs = []
    for start in range(n):
        run_p = np.maximum.accumulate(sp[:, start:], axis=1)
        run_c = np.maximum.accumulate(sc[:, start:], axis=1)
        if layout == "packed":
            cost = np.cumsum(sr[:, start:], axis=1)  # (world, rows left): cost of taking b rows
        else:  # sorted longest first: the first row is the widest
            cost = np.arange(1, n - start + 1) * sr[:, start:start + 1]
        fits = int((cost <= budget).all(axis=0).sum())  # cost grows with b: the first misfit ends the run
        if fits == 0:
            r = int(np.argmax(cost[:, 0]))
            row = int(order[r, start])
            raise ValueError(f"odb rank {r}: rollout row {row} alone costs {int(cost[r, 0])} padded tokens (a prompt "
                             f"of {int(prompt[r, row])} and a completion of {int(completion[r, row])} tokens, widths "
                             f"rounded to pad_to_multiple_of={multiple}), over token_budget={budget}. Rule: a "
                             f"micro-batch holds at least one row and stays within the budget. Fix: raise "
                             f"token_budget to at least the longest prompt plus max_completion_length.")
        runs.append((cost[:, :fits], run_p[:, :fits], run_c[:, :fits]))
    # least total cost from each start to the end (a shortest path over the cut points, fewest rows last on ties)
    best = np.zeros(n + 1)
    take = np.zeros(n, dtype=np.int64)
    for start in range(n - 1, -1, -1):
        cost = runs[start][0]
        total = cost.max(axis=0) + overhead + best[start + 1:start + 1 + cost.shape[1]]
        b = int(np.flatnonzero(total <= total.min() + 1e-9)[-1])  # the most rows among the least costs
        best[start], take[start] = total[b], b + 1
    sizes, widths, costs, start = [], [], [], 0
    while start < n:
        fits = int(take[start])
        cost, run_p, run_c = runs[start]
        sizes.append(fits)
        widths.append(np.stack([run_p[:, fits - 1], run_c[:, fits - 1]], axis=1))
        costs.append(cost[:, fits - 1])
        start += fits
    width_arr = np.stack(widths, axis=1) if widths else np.zeros((world, 0, 2), dtype=np.int64)
    cost_arr = np.stack(costs, axis=1) if costs else np.zeros((world, 0), dtype=np.int64)
    return RolloutPlan.of(order, tuple(sizes), width_arr, cost_arr)
