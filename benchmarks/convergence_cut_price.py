"""Does the price of a micro-step decide how fast odb runs group_by_length's own steps at A = 1?

The convergence section's goal "odb padded on group_by_length's steps / group_by_length <= 0.95 at
A = 1" sits near its reading (0.96 in the published run, a bound of 0.88 from the packed arm on the
same steps). odb cuts each step into the micro-batches of least padded tokens plus ``micro_batch_cost``
per micro-batch (a sixteenth of the budget by default: 256 tokens here). This script runs the section's
A = 1 arms that hold group_by_length's steps (with fixed, which sets the target, and group_by_length
itself) at the section's full size (2 gloo ranks, 3 interleaved rounds) once per price, and prints per
price: odb's time to the target over group_by_length's (median and the rounds' spread), its padding
share, micro-steps per step and seconds per step against group_by_length's.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/convergence_cut_price.py [price ...]`` (default: the
default price and 64 tokens; about 2.5 minutes a price on 2 cores).
"""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Optional

from odb.bench.convergence import SIZES
from odb.bench.convergence_run import run_convergence_section

ARMS = ["fixed", "group_by_length", "odb_gbl_padded", "odb_gbl_packed"]


def one_price(price: Optional[float]) -> Dict[str, Any]:
    """The A = 1 figures of odb padded on group_by_length's steps at ``price`` (None: odb's default)."""
    size = {**SIZES["full"], "accumulations": [1], "micro_batch_cost": price}
    conv = run_convergence_section(size=size, arms=ARMS)
    goal = next(g for g in conv["goals"] if g["arms"] == ["odb_gbl_padded", "group_by_length"])
    costs = conv["breakdowns"]["1"]
    mine, theirs = costs["odb_gbl_padded"], costs["group_by_length"]
    return {"price": "default (256)" if price is None else f"{price:g}", "ratio": goal["measured"],
            "spread": goal["spread"], "padding": mine["padding_share"], "micro": mine["micro_steps_per_step"],
            "step_ratio": (mine["train_s"] / mine["steps"]) / (theirs["train_s"] / theirs["steps"]),
            "bound": (goal.get("bound") or {}).get("bound")}


def main(argv: List[str]) -> None:
    prices: List[Optional[float]] = [float(a) for a in argv] if argv else [None, 64.0]
    rows = [one_price(p) for p in prices]
    print(f"\n{'micro_batch_cost':>16} {'time to target / gbl':>22} {'padding':>8} {'micro-steps':>11} "
          f"{'s per step / gbl':>16} {'bound':>6}")
    for r in rows:
        spread = f"{r['spread'][0]:.3f}-{r['spread'][1]:.3f}" if r["spread"] else "-"
        bound = "-" if r["bound"] is None else f"{r['bound']:.3f}"
        print(f"{r['price']:>16} {r['ratio']:>8.3f} ({spread:>11}) {r['padding']:>8.3f} {r['micro']:>11.2f} "
              f"{r['step_ratio']:>16.3f} {bound:>6}")


if __name__ == "__main__":
    main(sys.argv[1:])
