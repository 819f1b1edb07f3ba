"""Time odb.plan.steps.global_plan.plan_global_step on one step of W ranks x S samples, and score its plans.

Each step's lengths are heavy-tailed: log-normal with median 128 and sigma 1.0, rounded and clipped to
[8, 1024] (mean ~205 tokens). The cost model is ``token_budget=4096``; a micro-batch costs ``overhead=256``
tokens more. The figures are the median wall and CPU time of one plan_global_step call over --runs steps
(different lengths each), on one core (plain numpy, no threads of its own), with the step's DDP and FSDP
efficiency (odb.plan.steps.global_plan.step_efficiency) averaged over the steps, next to the per-rank plan's: each
rank cutting its own S consecutive samples with odb.plan.steps.step_cut.plan_step_share, M = the most
micro-batches of any rank, ghosts filling the rest. slowest/bound: the global plan's slowest rank over the
plan's lower bound (GlobalStepPlan.bound), averaged.

    python benchmarks/global_plan_speed.py                 # 1024x16, 128x16, 8x4; padded and packed
    python benchmarks/global_plan_speed.py --runs 5 --mode ddp
"""

from __future__ import annotations

import argparse
import time
from typing import List, Optional, Tuple

import numpy as np

from odb.plan.costs.cost import CostModel
from odb.plan.steps.global_plan import GlobalStepPlan, plan_global_step, step_efficiency
from odb.plan.steps.step_cut import plan_step_share

BUDGET = 4096
OVERHEAD = 256.0
SHAPES = ((1024, 16), (128, 16), (8, 4))


def heavy_lengths(n: int, seed: int) -> np.ndarray:
    """n lengths: log-normal with median 128 and sigma 1.0, rounded, clipped to [8, 1024]."""
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(np.exp(rng.normal(np.log(128.0), 1.0, n))), 8, 1024).astype(np.int64)


def per_rank_plan(lengths: np.ndarray, world: int, cost: CostModel) -> GlobalStepPlan:
    """Each rank's own share cut alone (plan_step_share), padded with ghosts to the most micro-batches."""
    share = len(lengths) // world
    groups = [[g + r * share for g in plan_step_share(lengths[r * share:(r + 1) * share], np.arange(share), cost,
                                                      OVERHEAD).groups] for r in range(world)]
    m = max(len(g) for g in groups)
    ranks = [g + [np.empty(0, dtype=np.int64)] * (m - len(g)) for g in groups]
    costs = np.array([sum(cost.group_cost(lengths[g][:, None]) for g in gs) + m * OVERHEAD for gs in groups])
    return GlobalStepPlan(ranks, np.empty(0, dtype=np.int64), costs, 0.0)


def measure(world: int, per_rank: int, layout: str, runs: int, fsdp: Optional[bool]) -> Tuple[float, ...]:
    cost = CostModel((BUDGET,), layout=layout)
    times: List[float] = []
    cpu: List[float] = []
    scores = []
    for seed in range(runs):
        lengths = heavy_lengths(world * per_rank, seed)
        start, start_cpu = time.perf_counter(), time.process_time()
        plan = plan_global_step(lengths, world, cost, OVERHEAD, fsdp=fsdp)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
        base = per_rank_plan(lengths, world, cost)
        scores.append(step_efficiency(lengths, plan, cost, OVERHEAD) + step_efficiency(lengths, base, cost, OVERHEAD)
                      + (plan.micro_steps, base.micro_steps, plan.rank_costs.max() / plan.bound))
    s = np.mean(np.array(scores), axis=0)
    return (float(np.median(times)) * 1e3, float(np.median(cpu)) * 1e3) + tuple(float(v) for v in s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="steps per shape (default 20)")
    parser.add_argument("--mode", choices=("either", "ddp", "fsdp"), default="either",
                        help="plan_global_step's fsdp argument: None (either, the default), False (ddp), True (fsdp)")
    args = parser.parse_args()
    fsdp = {"either": None, "ddp": False, "fsdp": True}[args.mode]
    print(f"token_budget={BUDGET}, overhead={OVERHEAD:.0f}, lengths log-normal(median 128, sigma 1) in [8, 1024], "
          f"{args.runs} steps per row, fsdp={fsdp}")
    print(f"{'layout':7} {'ranks x samples':>15} {'median ms':>10} {'cpu ms':>7} {'DDP eff':>8} {'FSDP eff':>9} "
          f"{'M':>5} {'per-rank DDP':>13} {'per-rank FSDP':>14} {'per-rank M':>11} {'slowest/bound':>14}")
    for layout in ("padded", "packed"):
        for world, per_rank in SHAPES:
            ms, cpu, ddp, fs, base_ddp, base_fs, m, base_m, gap = measure(world, per_rank, layout, args.runs, fsdp)
            print(f"{layout:7} {f'{world} x {per_rank}':>15} {ms:10.2f} {cpu:7.2f} {ddp:8.3f} {fs:9.3f} {m:5.2f} "
                  f"{base_ddp:13.3f} {base_fs:14.3f} {base_m:11.2f} {gap:14.3f}")


if __name__ == "__main__":
    main()
