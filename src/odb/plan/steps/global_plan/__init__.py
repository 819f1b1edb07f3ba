"""One optimizer step's samples planned jointly over all data-parallel ranks (pure numpy).

With ``global_batch_size=G`` a step holds exactly G given samples, the union over W ranks. Each rank
runs M micro-batches (the same M on every rank: a rank with nothing for a micro-step runs a *ghost*, an
empty forward) and the slowest rank sets the step time (DDP waits at the step's all-reduce, FSDP at
every micro-step). A rank's cost is the sum over its micro-batches of ``cost.group_cost`` plus the fixed
cost of one micro-batch (``overhead``, config ``micro_batch_cost``). ``plan_global_step`` assigns all the
step's samples to (rank, micro-batch) cells so that the slowest rank costs little, and so that the j-th
micro-batches of the ranks cost alike (FSDP meets there):

* Padded layout: the samples, sorted as the window planner sorts them (``SortedPool``), are cut into
  K = W x M consecutive runs, each within the budget. For each candidate M (from the fewest micro-steps
  the budget allows, up while M's lower bound can still beat the best plan so far) the runs are cut
  *slot by slot*: the next W runs take the longest samples left, each as long as a cap c_j allows, c_j
  being the least cap under which the samples left fit the runs left (a search on the cap with the exact
  greedy count; with one dimension, no side costs and no ``batch_size_multiple`` the count walks blocks of
  samples that take one step at a time and the slot before's cap is tried first). The caps fall from slot to
  slot, so the runs of a slot cost about the same, and a long sample that forces a high cap makes the
  other runs of its slot take more samples. Runs are split (the costliest, at its best cut) while there
  are fewer than K: a rank runs a ghost only when the step has fewer samples than cells.
* Packed layout (a micro-batch is one row costing the sum of its samples' weights): K = W x M rows, M from
  ceil(total weight / budget / W) up; the samples, heaviest first, each go to the least-loaded row that
  can take them (LPT, in vectorised rounds); when one fits no row, best-fit decreasing rows
  (``odb.plan.windows.packing``) split up to K, or a larger M.
* Dealing: the K micro-batches by cost, micro-step j takes the j-th W of them and gives the costliest to
  the rank whose total is the least so far (each micro-step balanced, and the ranks' totals); with ghosts
  the costliest also go, one at a time, to the rank with the least total that has a free micro-step.
* Evening out: the last micro-step may instead be cut to complement the ranks' totals after the others
  (bisect the slowest total; the least-loaded rank first takes the longest run within it); then a local
  search on the slowest rank moves samples to a neighbouring run of another rank, swaps a run with a
  cheaper one of the same micro-step, or hands a run to another rank's ghost (packed: moves one sample to
  another rank's row), while that lowers it (at most 32 moves).

``fsdp`` says where ranks wait. Default (None): the slowest rank first, the FSDP step time (the sum over
micro-steps of the costliest micro-batch) second, and evening out never makes a micro-step's costliest
micro-batch costlier. False (DDP only): evening out may (on heavy-tailed steps of 8 and 1,024 ranks: DDP
efficiency +0.4 to +0.7 points, FSDP efficiency -4 to -6 points). True: the FSDP time first. One rank (W = 1) in the padded layout also tries
the least-cost cut of ``odb.plan.steps.step_cut`` (the optimum over cuts of the sorted samples for one rank), as
does a step of at most 64 samples; every candidate is scored by its dealt plan.

The package, one job a module:

* this module: ``plan_global_step``, the entry point (checks its arguments, runs the layout's search);
* ``result``: the planned step (``GlobalStepPlan``) and the empty array every ghost micro-batch shares;
* ``candidate``: a candidate's micro-batches dealt to ranks and micro-steps, scored, compared, emitted as a
  plan; the lower bound;
* ``runs``: the padded layout's runs of the sorted samples: what a run costs, the greedy cuts under a cap;
* ``padded``: the padded layout's search (slot-by-slot cuts, the complemented last micro-step, local search);
* ``packed``: the packed layout's search (LPT rows, best-fit rows split, local search);
* ``efficiency``: the DDP and FSDP efficiency of a planned step (``step_efficiency``).

Example:
    >>> cost = CostModel((100,))
    >>> plan = plan_global_step(np.array([50, 48, 12, 10, 10, 9, 30, 30]), 2, cost, overhead=10.0)
    >>> [[g.tolist() for g in groups] for groups in plan.ranks]   # micro-step 0: 30+30 and 50; then 48 and 48
    [[[6, 7], [2, 3, 4, 5]], [[0], [1]]]
    >>> plan.rank_costs.tolist(), plan.bound
    ([128.0, 118.0], 119.5)
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.steps.global_plan.efficiency import step_efficiency
from odb.plan.steps.global_plan.packed import _plan_packed
from odb.plan.steps.global_plan.padded import _plan_padded
from odb.plan.steps.global_plan.result import GlobalStepPlan

__all__ = ["GlobalStepPlan", "plan_global_step", "step_efficiency"]


def plan_global_step(lengths: np.ndarray, world: int, cost: CostModel, overhead: float,
                     patches: Optional[np.ndarray] = None, alone: bool = False, *, fsdp: Optional[bool] = None,
                     max_micro_steps: Optional[int] = None) -> GlobalStepPlan:
    """Assign one step's samples to W ranks x M micro-batches, each within the budget, so that the slowest
    rank costs little (the module docstring says how).

    Args:
        lengths: (n,) or (n, D) int lengths of the step's samples (all ranks' together).
        world: W, the number of data-parallel ranks.
        cost: the cost model (budget, padding, layout, side costs, ``batch_size_multiple``).
        overhead: the fixed cost of one micro-batch in tokens (``micro_batch_cost``), ghosts included.
        patches: the samples' side counts when a patch cap or side costs are set: None, (n,) image patches
            or (n, 2) image patches and supervised tokens (``odb.plan.costs.cost.split_side``).
        alone: samples that alone exceed the budget become micro-batches of their own instead of ``oversize``.
        fsdp: where the ranks wait. None (default, either): the slowest rank first, then the sum over micro-steps
            of the costliest micro-batch, and the ranks' totals are never evened out by making a micro-step's
            costliest micro-batch costlier. False (DDP: the ranks meet once a step): the slowest rank alone, which
            may unbalance micro-steps for a little gain (the module docstring has figures). True (FSDP: they meet
            at every micro-step): that sum first, the slowest rank second, micro-steps protected.
        max_micro_steps: the most micro-steps the plan may take (the loader's per-step messages hold a rank's
            share, one entry per micro-step): a plan that would slow its slowest rank least with more (few
            samples per rank, one of them long) is not considered. None: no limit. It never goes below the
            fewest micro-steps the budget allows.

    Returns a ``GlobalStepPlan``. Every sample not oversize is in exactly one micro-batch; every micro-batch
    fits the budget (as ``cost.max_counts_sorted`` / ``odb.plan.windows.packing`` say) and, padded, has a size that
    is a multiple of ``batch_size_multiple`` where ``least_cost_segments`` asks for one; same input, same plan.

    ``bound`` = max(S / W, s_max) + M_lb x overhead, where s_k is a lower bound on the cost of any micro-batch
    holding sample k (padded: its padded tokens plus the floor of its side cost; packed: the floor of its
    weight), S the sum and s_max the largest of them over the planned samples, and M_lb = ceil(N / W) with N
    a lower bound on the number of micro-batches (padded: ceil(sum of 1 / copies of each sample that fit a
    batch); packed: ceil(total weight / budget), or n / max_batch_size; plus one per sample planned alone).
    Any plan's slowest rank costs at least that: the ranks' costs sum to at least S + W x M x overhead, and
    the rank holding the costliest sample pays s_max plus M overheads, with M >= M_lb.

    Example:
        >>> plan = plan_global_step(np.array([60, 10, 10, 10, 10, 10, 200]), 2, CostModel((100,)), 5.0)
        >>> [[g.tolist() for g in groups] for groups in plan.ranks], plan.oversize.tolist()
        ([[[0]], [[1, 2, 3, 4, 5]]], [6])
        >>> plan.rank_costs.tolist()
        [65.0, 55.0]
        >>> alone = plan_global_step(np.array([60, 10, 10, 10, 10, 10, 200]), 2, CostModel((100,)), 5.0, alone=True)
        >>> [[g.tolist() for g in groups] for groups in alone.ranks], alone.oversize.tolist(), alone.rank_costs.tolist()
        ([[[6], [4, 5]], [[0], [1, 2, 3]]], [], [230.0, 100.0])
        >>> ddp = plan_global_step(np.array([60, 10, 10, 10, 10, 10, 200]), 2, CostModel((100,)), 5.0, alone=True,
        ...                        fsdp=False)  # the slowest rank first: micro-step 1 may cost more (40, not 30)
        >>> [[g.tolist() for g in groups] for groups in ddp.ranks], ddp.rank_costs.tolist()
        ([[[6], [5]], [[0], [1, 2, 3, 4]]], [220.0, 110.0])
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.ndim == 1:
        lengths = lengths[:, None]
    if lengths.ndim != 2:
        raise ValueError(f"lengths has shape {lengths.shape}: pass (n,) or (n, D) int lengths of the step's samples.")
    world = int(world)
    if world < 1:
        raise ValueError(f"world={world}: the number of data-parallel ranks must be >= 1.")
    overhead = float(overhead)
    if not np.isfinite(overhead) or overhead < 0:
        raise ValueError(f"overhead={overhead!r}: the cost of one micro-batch must be a finite number >= 0 (tokens).")
    cost.check_dims(lengths.shape[1])
    side = None if patches is None else np.asarray(patches)
    if cost.packed:
        return _plan_packed(lengths, world, cost, overhead, side, alone, fsdp, max_micro_steps)
    return _plan_padded(lengths, world, cost, overhead, side, alone, fsdp, max_micro_steps)
