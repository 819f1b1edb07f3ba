"""Draw how the planner treats one window (docs/img/planner.png).

    python scripts/plot_planner.py
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from odb.bench.workloads import lognormal_lengths  # noqa: E402
from odb.config import ODBConfig  # noqa: E402
from odb.plan.costs.cost import CostModel  # noqa: E402
from odb.plan.windows.planner import plan_window  # noqa: E402


def main() -> None:
    lengths = lognormal_lengths(900, 1.0, 256, seed=3)
    cfg = ODBConfig(token_budget=16384, buffer_size=256)
    plan = plan_window(lengths, np.arange(len(lengths)), CostModel.from_config(cfg), final=False,
                       pack_efficiency=cfg.pack_efficiency, carry_limit=cfg.carry_limit)
    fig, ax = plt.subplots(figsize=(10, 4.2))
    order = np.argsort(-lengths, kind="stable")
    rank = {int(i): k for k, i in enumerate(order)}
    for g, group in enumerate(plan.groups):
        xs = [rank[int(i)] for i in group]
        ax.bar(xs, lengths[group], width=1.0, color=f"C{g % 10}", alpha=0.85)
        ax.hlines(lengths[group].max(), min(xs) - 0.5, max(xs) + 0.5, color="k", lw=0.8)
    carried = [rank[int(i)] for i in plan.carry]
    ax.bar(carried, lengths[plan.carry], width=1.0, color="lightgrey", hatch="//", edgecolor="grey",
           label=f"carried to the next window ({len(plan.carry)})")
    ax.set_yscale("log")
    ax.set_xlabel("samples of one window, sorted by length")
    ax.set_ylabel("tokens (log)")
    ax.set_title(f"One window of 256 samples (log-normal, CV 1.0), budget 16384\n{len(plan.groups)} batches "
                 f"emitted (colours; black line: the batch's padded length L), the rest carried")
    ax.legend(loc="upper right")
    fig.tight_layout()
    out = Path(__file__).resolve().parent.parent / "docs" / "img" / "planner.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
