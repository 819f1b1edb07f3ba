"""Tables (plain text and Markdown) and the plot of a benchmark ``results.json``.

``python -m odb.bench.report out/bench/results.json`` prints the Markdown tables that
docs/benchmarks.md quotes.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Sequence

PLAN_COLUMNS = [
    ("method", None), ("steps", "{:d}"), ("useful fill", "{:.3f}"), ("/ oracle", "{:.3f}"),
    ("token eff.", "{:.3f}"), ("budget fill", "{:.3f}"), ("single", "{:.4f}"), ("over budget", "{:.3f}"),
    ("order rho", "{:+.3f}"), ("mean abs disp.", "{:.0f}"), ("window/budget", "{:.1f}"), ("plan ms/window", "{:.1f}"),
]
_PLAN_KEYS = {"steps": "steps", "useful fill": "useful_fill", "/ oracle": "ratio_to_oracle",
              "token eff.": "token_efficiency", "budget fill": "budget_fill", "single": "single_sample_fraction",
              "over budget": "over_budget_batches", "order rho": "order_spearman",
              "mean abs disp.": "mean_abs_displacement", "window/budget": "window_in_budgets",
              "plan ms/window": "window_plan_ms_mean"}
METHOD_ORDER = ["fixed", "length_grouped", "batch_rebalance", "odb-256", "odb-512", "odb-1024", "odb-2048", "oracle"]


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _methods(methods: Dict[str, Any]) -> List[str]:
    known = [m for m in METHOD_ORDER if m in methods]
    return known + [m for m in methods if m not in known]


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
    fmt = "  ".join("{:>%d}" % w for w in widths)
    return "\n".join([fmt.format(*header)] + [fmt.format(*r) for r in rows])


def planning_tables(planning: Dict[str, Any], markdown: bool = False) -> str:
    out = []
    for name, w in planning["workloads"].items():
        means = " / ".join(f"{m:.0f}" for m in w["mean_length"])
        out.append(f"{'### ' if markdown else ''}{name}: {w['samples']} samples, mean length {means}, "
                   f"fixed B={w['fixed_batch_size']}, budget {planning['token_budget']}")
        rows = [[m] + [_fmt(w["methods"][m].get(_PLAN_KEYS[c]), spec) for c, spec in PLAN_COLUMNS[1:]]
                for m in _methods(w["methods"])]
        out.append(_table([c for c, _ in PLAN_COLUMNS], rows, markdown))
        out.append("")
    missing = [k for k, v in planning["transformers_samplers"].items() if not v]
    if missing:
        out.append(f"not installed in this transformers: {', '.join(missing)}")
    return "\n".join(out)


def summary_table(planning: Dict[str, Any], buffers: Sequence[int] = (512, 2048), markdown: bool = False) -> str:
    """ODB / oracle useful fill per workload at a few buffer sizes, beside the baselines."""
    base = [m for m in ("fixed", "length_grouped", "batch_rebalance")
            if any(m in w["methods"] for w in planning["workloads"].values())]
    header = ["workload"] + base + [f"odb-{b}" for b in buffers] + ["odb single (max)"]
    rows = []
    for name, w in planning["workloads"].items():
        ms = w["methods"]
        odb = [k for k in ms if k.startswith("odb-")]
        single = max(ms[k]["single_sample_fraction"] for k in odb) if odb else None
        rows.append([name] + [_fmt(ms.get(m, {}).get("ratio_to_oracle"), "{:.3f}") for m in base]
                    + [_fmt(ms.get(f"odb-{b}", {}).get("ratio_to_oracle"), "{:.3f}") for b in buffers]
                    + [_fmt(single, "{:.4f}")])
    return _table(header, rows, markdown)


def loader_table(loader: Dict[str, Any], markdown: bool = False) -> str:
    header = ["loader", "samples", "samples/s", "CPU s (all procs)", "CPU ms/sample", "first batch s"]
    rows = []
    for name, m in loader["median"].items():
        rows.append([name, f"{m['samples']:.0f}", f"{m['samples_per_s']:.0f}", f"{m['cpu_s']:.2f}",
                     f"{1e3 * m['cpu_s'] / m['samples']:.3f}", f"{m['first_batch_s']:.3f}"])
    r, g, met = loader["ratios"], loader["goals"], loader["goals_met"]
    lines = [_table(header, rows, markdown), "",
             f"ODB / plain bs{loader['batch_size']}: samples/s x{r['samples_per_s_ratio']:.2f} "
             f"(goal >= {g['samples_per_s_ratio_min']}: {'met' if met['samples_per_s_ratio'] else 'MISSED'}), "
             f"CPU s x{r['cpu_s_ratio']:.2f} (goal <= {g['cpu_s_ratio_max']}: "
             f"{'met' if met['cpu_s_ratio'] else 'MISSED'}), first batch {r['first_batch_extra_s']:+.3f} s "
             f"(goal <= +{g['first_batch_extra_s_max']}: {'met' if met['first_batch_extra_s'] else 'MISSED'}); "
             f"loader throughput ratio (ODB / plain bs1) x{r['loader_throughput_ratio']:.2f}"]
    return "\n".join(lines)


def training_table(training: Dict[str, Any], markdown: bool = False) -> str:
    header = ["arm", "steps", "mean B", "token eff.", "wall s", "real tokens/s", "final loss"]
    cuda = "peak_memory_mib" in training["odb"]
    if cuda:
        header.append("peak MiB")
    rows = []
    for arm in ("fixed", "odb"):
        m = training[arm]
        row = [arm if arm == "odb" else f"fixed B={training['fixed_batch_size']}", str(m["steps"]),
               f"{m['mean_batch_size']:.1f}", f"{m['token_efficiency']:.3f}", f"{m['wall_s']:.1f}",
               f"{m['real_tokens_per_s']:.0f}", f"{m['final_loss']:.3f}"]
        if cuda:
            row.append(f"{m['peak_memory_mib']:.0f}")
        rows.append(row)
    return _table(header, rows, markdown) + (
        f"\n\ntraining speedup (real tokens/s, ODB / fixed): x{training['speedup']:.2f} "
        f"(goal >= {training['goal_speedup_min']})")


def ranks_table(ranks: Dict[str, Any], markdown: bool) -> str:
    rows = [[name, w["steps"], f"{w['imbalance_mean']:.3f}", f"{w['imbalance_p95']:.3f}",
             f"{w['ghost_fraction_max']:.4f}", f"{w['useful_fill']:.3f}", w["split_groups"]]
            for name, w in ranks["workloads"].items()]
    head = ["workload", "steps/rank", "imbalance mean", "imbalance p95", "ghost fraction", "useful fill", "splits"]
    return _table(head, [[str(c) for c in row] for row in rows], markdown) + (f"\nalignment: {ranks['align_ms_per_window']:.3f} ms per window at "
                                          f"{ranks['align_world']} simulated ranks (pure planning, one rank)")


def render(results: Dict[str, Any], markdown: bool = False) -> str:
    h = "## " if markdown else "== "
    parts = [f"{h}Planner quality (useful fill / oracle)", summary_table(results["planning"], markdown=markdown), "",
             f"{h}Planner details", planning_tables(results["planning"], markdown)]
    if "ranks" in results:
        parts += [f"{h}Ranks ({results['ranks']['world']} simulated, buffer {results['ranks']['buffer_size']})",
                  ranks_table(results["ranks"], markdown), ""]
    if "loader" in results:
        parts += [f"{h}Loader speed (medians of {results['loader']['repeats']})",
                  loader_table(results["loader"], markdown), ""]
    if "training" in results:
        parts += [f"{h}Training ({results['training']['device']})", training_table(results["training"], markdown),
                  ""]
    return "\n".join(parts)


def plot_step_metrics(loader: Dict[str, Any], path: str) -> None:
    """Per-step metrics of one odb epoch (batch size, padding, buffer occupancy, loader wait)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = loader.get("odb_step_metrics") or {}
    keys = [k for k in ("batch_size", "padding_ratio", "buffered_samples", "loader_wait_ms") if k in series]
    if not keys:
        return
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 1.8 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        ax.plot(series[key], lw=0.8)
        ax.set_ylabel(key.replace("_", " "))
    axes[-1, 0].set_xlabel(f"step of one odb epoch ({loader['samples']} samples, budget {loader['token_budget']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(results: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planning = results["planning"]
    panels = 1 + ("loader" in results) + ("training" in results)
    fig, axes = plt.subplots(1, panels, figsize=(6 + 3.5 * panels, 4.8),
                             gridspec_kw={"width_ratios": [3] + [1] * (panels - 1)}, squeeze=False)
    ax = axes[0][0]
    names = list(planning["workloads"])
    methods = [m for m in METHOD_ORDER if m != "oracle"
               and any(m in w["methods"] for w in planning["workloads"].values())]
    width = 0.8 / len(methods)
    for k, m in enumerate(methods):
        ys = [planning["workloads"][n]["methods"].get(m, {}).get("ratio_to_oracle", 0.0) for n in names]
        ax.bar([i + (k - (len(methods) - 1) / 2) * width for i in range(len(names))], ys, width, label=m)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("useful fill / oracle")
    ax.set_title(f"Planner quality (budget {planning['token_budget']})")
    ax.set_ylim(0, 1.2)
    ax.legend(fontsize=7, ncol=4, loc="upper center")
    col = 1
    if "loader" in results:
        ax = axes[0][col]
        med = results["loader"]["median"]
        ax.bar(list(med), [m["samples_per_s"] for m in med.values()], color=["C0", "C3", "C7"][:len(med)])
        ax.set_ylabel("samples/s")
        ax.set_title(f"Loader ({results['loader']['num_workers']} workers)")
        col += 1
    if "training" in results:
        ax = axes[0][col]
        tr = results["training"]
        ax.bar([f"fixed B={tr['fixed_batch_size']}", "odb"],
               [tr["fixed"]["real_tokens_per_s"], tr["odb"]["real_tokens_per_s"]], color=["C0", "C3"])
        ax.set_ylabel("real tokens/s")
        ax.set_title(f"Training ({tr['device']}, x{tr['speedup']:.2f})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "out/bench/results.json") as f:
        print(render(json.load(f), markdown=True))
