"""The VLM table over more rounds than the benchmark's three: odb's arms against group_by_length's tokens/s.

The VLM section of ``python -m odb.bench`` (``odb.bench.vlm_training``: a tiny Qwen2-VL and LLaVA, one
process, one torch thread) trains one epoch of 480 samples per arm and round, about a second each, so
its three rounds leave a spread of +-10% around each median; the goal "odb's best arm no slower than
group_by_length" then reads near 1.0 on LLaVA, where group_by_length already pads 3%. This script runs
the same workloads, arms and interleaving for ``--rounds`` rounds and prints, per workload and odb arm,
its tokens/s over group_by_length's: the ratio of the medians (what the section reports) and the
median and spread of the rounds' own ratios (each round's arms trained from the same weights, one after
another).

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/vlm_rounds.py [--rounds 9] [--out FILE]``
(about 15 s a round on 2 cores; the workloads' results go to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Any, Dict, List

import torch

from odb.bench.vlm_training import ODB_ARMS, SIZES, run_workload

BASE = "group_by_length"


def rows(workload: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per odb arm: the ratio of medians over group_by_length's tokens/s and its rounds' own ratios."""
    arms = workload["arms"]
    med = {a: m["tokens_per_s"]["median"] for a, m in arms.items()}
    out = []
    for arm in ODB_ARMS:
        ratios = [a / b for a, b in zip(arms[arm]["tokens_per_s_rounds"], arms[BASE]["tokens_per_s_rounds"])]
        out.append({"arm": arm, "ratio_of_medians": med[arm] / med[BASE], "round_ratios": ratios,
                    "median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                    "rounds_at_least_1": sum(r >= 1.0 for r in ratios)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds (default 9)")
    ap.add_argument("--out", default="out/vlm_rounds.json", help="where the workloads' results go")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the section runs
    results: Dict[str, Any] = {"rounds": args.rounds, "workloads": {}}
    try:
        for name, cap, n, acc in SIZES["full"]["workloads"]:
            w = run_workload(name, cap, n, acc, args.rounds)
            w["goal_rows"] = rows(w)
            results["workloads"][name] = w
    finally:
        torch.set_num_threads(threads)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"\nVLM training, 1 process, {args.rounds} rounds: odb's tokens/s over group_by_length's")
    print(f"{'workload':<10} {'odb arm':<20} {'ratio of medians':>16} {'rounds median':>14} {'spread':>13} "
          f"{'rounds >= 1':>11}")
    for name, w in results["workloads"].items():
        for r in w["goal_rows"]:
            print(f"{name:<10} {r['arm']:<20} {r['ratio_of_medians']:>16.3f} {r['median']:>14.3f} "
                  f"{r['min']:>6.3f}-{r['max']:<6.3f} {r['rounds_at_least_1']:>5}/{args.rounds}")
    print(f"results: {args.out}")


if __name__ == "__main__":
    main()
