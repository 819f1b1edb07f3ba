"""The benchmark at a glance: one row per setting (odb's best arm against the best other arm), the
one-screen summary ``make demo`` opens with, and the README's plot of held-out loss against time.

Each row reads a section of a results file (``python -m odb.bench``'s ``results.json``) and leaves out a
setting the file does not hold:

- convergence, 2 ranks, A = 1 and A = 8: seconds to the target loss (arms that make the user's updates; an arm
  whose steps hold fixed's samples read at fixed's target step, as the section's goals read it), median (min-max)
  over rounds, and the ratio with its min-max over the same rounds;
- scale, 32 and 1,024 ranks (ShareGPT lengths, 16 samples per rank): DDP step efficiency, median (p10-p90) over
  the cell's steps (higher is better);
- vision-language training, per model: real tokens/s, median (min-max) over rounds, the ratio's widest spread;
- GRPO policy update: seconds per optimizer step at equal rollouts, median (min-max), and the ratio's rounds.

Example:
    >>> headline_rows({})
    []
"""

from __future__ import annotations

from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from odb.bench.convergence_labels import LABELS
from odb.bench.verdict import paired_spread, ratio_spread

CONV_ARMS = LABELS  # the convergence section's own labels
NOT_SAME_UPDATES = ("odb_budget_filled",)  # more samples per optimizer step: not a competitor at the user's settings
SCALE_WORLDS, SCALE_SHARE, SCALE_WORKLOAD = (32, 1024), 16, "sharegpt"
VLM_NAMES = {"qwen2_vl": "Qwen2-VL", "llava": "LLaVA"}
# The arms of the README's plot: odb and what users pick instead.
PLOT_ARMS = ("fixed", "group_by_length", "trl_packing", "odb_padded", "odb_packed", "odb_length_grouped_packed")


class Row(NamedTuple):
    """One setting: what is measured, odb's best arm and its figure, the best other arm and its figure, and
    odb's ratio over it (with its spread where the rounds give one)."""

    setting: str
    measure: str
    odb: str
    odb_value: str
    other: str
    other_value: str
    ratio: str


def _spread(t: Optional[Dict[str, float]], spec: str, low: str = "min", high: str = "max") -> str:
    if not t:
        return "-"
    if t[low] == t[high]:  # one round (make demo), or no spread
        return spec.format(t["median"])
    return f"{spec.format(t['median'])} ({spec.format(t[low])}-{spec.format(t[high])})"


def _ratio(value: float, spread: Optional[Tuple[float, float]]) -> str:
    return f"{value:.2f}x" + ("" if spread is None else f" ({spread[0]:.2f}-{spread[1]:.2f})")


def _read(arm_round: Dict[str, Any]) -> Optional[float]:
    from odb.bench.convergence import read_time

    return read_time(arm_round)


def best_pair(arms: Dict[str, Any], figure: str, lower: bool) -> Optional[Tuple[str, str]]:
    """(odb's best arm, the best other arm) by the median of each arm's ``figure``, lower or higher better; None
    where either side has no arm. odb's arms are those whose name starts with "odb"."""
    odb = [a for a in arms if a.startswith("odb")]
    other = [a for a in arms if not a.startswith("odb")]
    if not odb or not other:
        return None
    pick = min if lower else max
    return (pick(odb, key=lambda a: arms[a][figure]["median"]), pick(other, key=lambda a: arms[a][figure]["median"]))


def convergence_rows(conv: Dict[str, Any]) -> List[Row]:
    """A = 1 and A = 8: the fastest odb arm and the fastest other arm to the target loss (lower is better)."""
    out = []
    for acc in sorted(conv.get("accumulations", {}), key=int):
        part = conv["accumulations"][acc]
        arms = {a: m for a, m in part["arms"].items() if a not in NOT_SAME_UPDATES and m.get("time_read_s")}
        pair = best_pair(arms, "time_read_s", lower=True)
        if pair is None:
            continue
        best_odb, best_other = pair
        a, b = arms[best_odb]["time_read_s"]["median"], arms[best_other]["time_read_s"]["median"]
        rounds = part.get("rounds") or []
        spread = paired_spread((_read(r["arms"][best_odb]), _read(r["arms"][best_other])) for r in rounds) \
            if len(rounds) > 1 else None
        out.append(Row(f"convergence, 2 ranks, A = {acc} (G = {part['global_batch_size']})", "s to target loss",
                       CONV_ARMS.get(best_odb, best_odb), _spread(arms[best_odb]["time_read_s"], "{:.1f}"),
                       CONV_ARMS.get(best_other, best_other), _spread(arms[best_other]["time_read_s"], "{:.1f}"),
                       _ratio(a / b, spread)))
    return out


def scale_rows(scale: Dict[str, Any]) -> List[Row]:
    """32 and 1,024 ranks at 16 samples per rank (ShareGPT lengths): DDP step efficiency (higher is better)."""
    w = (scale.get("workloads") or {}).get(SCALE_WORKLOAD)
    if not w:
        return []
    labels = scale.get("arm_labels", {})
    out = []
    for world in SCALE_WORLDS:
        cell = w["cells"].get(f"{world}x{SCALE_SHARE}")
        if not cell:
            continue
        arms = {a: m for a, m in cell["arms"].items() if "ddp" in m}
        pair = best_pair(arms, "ddp", lower=False)
        if pair is None:
            continue
        best_odb, best_other = pair
        a, b = arms[best_odb]["ddp"]["median"], arms[best_other]["ddp"]["median"]
        out.append(Row(f"scale, {world:,} simulated ranks x {SCALE_SHARE} samples per rank (ShareGPT lengths)",
                       "DDP step efficiency", labels.get(best_odb, best_odb),
                       _spread(arms[best_odb]["ddp"], "{:.3f}", "p10", "p90"), labels.get(best_other, best_other),
                       _spread(arms[best_other]["ddp"], "{:.3f}", "p10", "p90"), _ratio(a / b, None)))
    return out


def vlm_rows(vlm: Dict[str, Any]) -> List[Row]:
    """Per vision-language model: real tokens/s of the faster odb arm and of the faster other arm."""
    out = []
    for name, w in (vlm.get("workloads") or {}).items():
        arms = w["arms"]
        pair = best_pair(arms, "tokens_per_s", lower=False)
        if pair is None:
            continue
        best_odb, best_other = pair
        x, y = arms[best_odb]["tokens_per_s"], arms[best_other]["tokens_per_s"]
        out.append(Row(f"vision-language, {VLM_NAMES.get(name, name)}, 1 process (G = {w['global_batch_size']})",
                       "real tokens/s", CONV_ARMS.get(best_odb, best_odb), _spread(x, "{:,.0f}"),
                       CONV_ARMS.get(best_other, best_other), _spread(y, "{:,.0f}"),
                       _ratio(x["median"] / y["median"], ratio_spread(x, y))))
    return out


def rl_rows(rl: Dict[str, Any]) -> List[Row]:
    """The GRPO policy update at equal rollouts: seconds per optimizer step, odb's faster arm against TRL as is."""
    u = rl.get("update") or {}
    arms = u.get("arms") or {}
    if "trl" not in arms or "error" in rl:
        return []
    odb = [a for a in arms if a != "trl"]
    if not odb:
        return []
    best = min(odb, key=lambda a: arms[a]["update_s"]["median"])
    labels = rl.get("arm_labels", {})
    ratio = arms[best]["update_s"]["median"] / arms["trl"]["update_s"]["median"]
    spread = (u.get("ratio_spreads") or {}).get(best)
    return [Row(f"GRPO policy update, {u.get('world', 2)} ranks (TRL's GRPOTrainer)", "update s per step",
                labels.get(best, best), _spread(arms[best]["update_s"], "{:.2f}"), labels.get("trl", "trl"),
                _spread(arms["trl"]["update_s"], "{:.2f}"), _ratio(ratio, tuple(spread) if spread else None))]


def headline_rows(results: Dict[str, Any]) -> List[Row]:
    """Every setting the results hold, in the table's order."""
    rows: List[Row] = []
    if results.get("convergence"):
        rows += convergence_rows(results["convergence"])
    if results.get("scale") and "error" not in results["scale"]:
        rows += scale_rows(results["scale"])
    if results.get("vlm_training"):
        rows += vlm_rows(results["vlm_training"])
    if results.get("rl_update"):
        rows += rl_rows(results["rl_update"])
    return rows


HEADER = ("setting", "measure", "odb's best arm", "median (spread)", "best other arm", "median (spread)",
          "odb / other (spread)")


def headline_table(results: Dict[str, Any]) -> List[str]:
    """The rows as a Markdown table (lines); empty when the results hold none of the settings."""
    rows = headline_rows(results)
    if not rows:
        return []
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "|".join("---" for _ in HEADER) + "|"]
    for r in rows:
        lines.append("| " + " | ".join([r.setting, r.measure, f"**{r.odb}**", r.odb_value, r.other, r.other_value,
                                        r.ratio]) + " |")
    return lines


def summary_lines(results: Dict[str, Any], width: int = 118) -> List[str]:
    """The one-screen summary: one line per setting (plain text), then the goals met."""
    from odb.bench.report import goals

    out = []
    for r in headline_rows(results):
        better = "lower" if r.measure.startswith(("s ", "update s")) else "higher"
        out.append(f"- {r.setting}: {r.measure}, {better} better")
        out.append(f"    {r.odb} {r.odb_value}  vs  {r.other} {r.other_value}  ->  {r.ratio}")
    measured = [g for g in goals(results) if g.met is not None]
    if measured:
        met = sum(bool(g.met) for g in measured)
        close = sum(g.straddles for g in measured)
        out.append(f"- goals: {met} of {len(measured)} met by the median"
                   + (f" ({close} within the rounds' spread: another run could turn them)" if close else ""))
    return [line if len(line) <= width else line[:width - 3] + "..." for line in out]


def _median_round(rounds: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The round whose fixed arm took the median training time (the only round where there is one)."""
    if not rounds:
        return None
    if not all("fixed" in r["arms"] for r in rounds):
        return rounds[0]
    return sorted(rounds, key=lambda r: r["arms"]["fixed"]["train_s"])[len(rounds) // 2]


def plot_loss_vs_time(conv: Dict[str, Any], path: str, arms: Sequence[str] = PLOT_ARMS) -> None:
    """Held-out loss against training seconds, odb beside fixed, group_by_length and TRL packing, one panel per
    accumulation A (each panel one round: the round of fixed's median training time, every arm from it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accs = sorted(conv["accumulations"], key=int)
    fig, axes = plt.subplots(1, len(accs), figsize=(5.2 * len(accs), 3.6), squeeze=False)
    style = {"fixed": ("C0", "-"), "group_by_length": ("C1", "-"), "trl_packing": ("C3", "-"),
             "odb_padded": ("C4", "-"), "odb_packed": ("C5", "-"), "odb_length_grouped_packed": ("C2", "-")}
    for ax, acc in zip(axes[0], accs):
        part = conv["accumulations"][acc]
        shown = _median_round(part.get("rounds") or [])
        if shown is None:
            continue
        for arm in arms:
            if arm not in shown["arms"]:
                continue
            curve = shown["arms"][arm]["curve"]
            color, ls = style.get(arm, (None, "-"))
            width = 2.0 if arm.startswith("odb") else 1.2
            per_step = part["arms"][arm]["samples_per_step"]
            label = CONV_ARMS.get(arm, arm) + ("" if abs(per_step - part["global_batch_size"]) < 0.5
                                               else f" ({per_step:.0f} samples per step)")
            ax.plot([p["s"] for p in curve], [p["loss"] for p in curve], color=color, ls=ls, lw=width, marker=".",
                    label=label)
        ax.axhline(shown["target_loss"], color="k", lw=0.8, ls=":", label="target: fixed's final loss")
        ax.set_title(f"A = {acc}: {part['global_batch_size']} samples per optimizer step", fontsize=10)
        ax.set_xlabel("training seconds (2 DDP ranks, CPU)")
        ax.set_ylabel("held-out loss")
        ax.legend(fontsize=7)
    fig.suptitle(f"Same samples per step, same learning rate, cap {conv['cap']:,} padded tokens per micro-batch "
                 f"({conv['samples']} samples of real text)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
