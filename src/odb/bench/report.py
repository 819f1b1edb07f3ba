"""Tables (plain text and Markdown), the goal list and the plots of a benchmark ``results.json``.

``python -m odb.bench.report out/bench/results.json`` prints the Markdown tables that
docs/benchmarks.md quotes.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

from odb.bench.convergence_labels import LABELS
from odb.bench.verdict import spread_text, verdict

PLAN_COLUMNS = [
    ("method", None), ("steps", "{:d}"), ("token eff.", "{:.3f}"), ("tokens/step / cap", "{:.3f}"),
    ("useful fill / oracle", "{:.3f}"), ("padded/step / cap", "{:.3f}"), ("single", "{:.4f}"),
    ("over budget", "{:.3f}"), ("order rho", "{:+.3f}"), ("mean abs disp.", "{:.0f}"), ("window/budget", "{:.1f}"),
    ("plan ms/window", "{:.1f}"), ("plan us/sample", "{:.1f}"), ("peak held", "{:d}"),
]
_PLAN_KEYS = {"steps": "steps", "tokens/step / cap": "useful_fill", "useful fill / oracle": "ratio_to_oracle",
              "token eff.": "token_efficiency", "padded/step / cap": "budget_fill", "single": "single_sample_fraction",
              "over budget": "over_budget_batches", "order rho": "order_spearman",
              "mean abs disp.": "mean_abs_displacement", "window/budget": "window_in_budgets",
              "plan ms/window": "window_plan_ms_mean", "plan us/sample": "plan_us_per_sample",
              "peak held": "peak_held_samples"}
METHOD_ORDER = ["fixed", "length_grouped", "batch_rebalance", "odb-256", "odb-512", "odb-1024", "odb-2048",
                "odb-default", "oracle"]
SUMMARY_ODB = ("odb-512", "odb-2048", "odb-default")
_SHORT_NAMES = {"fixed": "fixed", "length_grouped": "group_by_length", "batch_rebalance": "BatchRebalance",
                "odb-default": "odb-default", "oracle": "oracle"}
PLANNING_LEGEND = (
    "token eff. = real / padded tokens (what share of the computed tokens is data); tokens/step / cap = mean real "
    "tokens per micro-batch / the budget (what share of the memory cap a step fills). The fixed-size samplers "
    "(fixed, LengthGrouped, BatchRebalance) keep fixed's batch size B (the largest whose worst case fits), so "
    "their tokens/step are equal by construction; they differ in token efficiency. useful fill / oracle = "
    "odb's tokens/step / the oracle's (the oracle knows every length, sorts them and cuts greedily under the "
    "budget: odb.bench.planning.oracle_batches, not odb's planner); it is shown for odb only.")


# One name per arm in every table and plot (results keys stay as they were: length_grouped, length-grouped).
ARM_NAMES = {"length_grouped": "group_by_length", "length-grouped": "group_by_length", "plain_replay": "plain replay",
             "batch_rebalance": "BatchRebalance", "oracle": "oracle"}


class Goal(NamedTuple):
    """One goal's row: its name, the measured figure (with the rounds' spread where it has one), the target,
    met or not by the median (None: not measured), and whether the spread straddles the target."""

    goal: str
    measured: str
    target: str
    met: Optional[bool]
    straddles: bool = False


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def _met(ok: Optional[bool]) -> str:
    return "-" if ok is None else ("met" if ok else "NOT MET")


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


def _window_text(settings: Dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in settings.items())


# ---- planning ------------------------------------------------------------------------------
def planning_tables(planning: Dict[str, Any], markdown: bool = False) -> str:
    out = [PLANNING_LEGEND, ""]
    for name, w in planning["workloads"].items():
        means = " / ".join(f"{m:.0f}" for m in w["mean_length"])
        out.append(f"{'### ' if markdown else ''}{name}: {w['samples']} samples, mean length {means}, "
                   f"fixed B={w['fixed_batch_size']}, budget {planning['token_budget']}")
        rows = []
        for m in _methods(w["methods"]):
            figures = dict(w["methods"][m])
            if not (m.startswith("odb-") or m == "oracle"):
                figures.pop("ratio_to_oracle", None)  # equal to fixed's by construction: says nothing
            rows.append([m] + [_fmt(figures.get(_PLAN_KEYS[c]), spec) for c, spec in PLAN_COLUMNS[1:]])
        out.append(_table([c for c, _ in PLAN_COLUMNS], rows, markdown))
        out.append("")
    missing = [k for k, v in planning["transformers_samplers"].items() if not v]
    if missing:
        out.append(f"not installed in this transformers: {', '.join(missing)}")
    return "\n".join(out)


def _summary_methods(planning: Dict[str, Any], buffers: Sequence[str]) -> List[str]:
    base = [m for m in ("fixed", "length_grouped", "batch_rebalance")
            if any(m in w["methods"] for w in planning["workloads"].values())]
    return base + list(buffers) + ["oracle"]


def summary_table(planning: Dict[str, Any], buffers: Sequence[str] = SUMMARY_ODB, markdown: bool = False) -> str:
    """Per workload, for every sampler side by side: token efficiency and tokens per step / cap; odb-default
    against LengthGroupedSampler and against the independent oracle; its order's rank correlation with length."""
    methods = _summary_methods(planning, buffers)
    label = {**_SHORT_NAMES, **{b: b for b in buffers}}
    header = (["workload", "mean len", "fixed B"] + [f"eff. {label[m]}" for m in methods]
              + [f"step/cap {label[m]}" for m in methods]
              + ["odb-default eff. - LengthGrouped", "odb-default useful fill / oracle", "odb-default order rho"])
    rows = []
    for name, w in planning["workloads"].items():
        ms = w["methods"]
        d = ms.get("odb-default", {})
        rows.append([name, " / ".join(f"{m:.0f}" for m in w["mean_length"]), str(w["fixed_batch_size"])]
                    + [_fmt(ms.get(m, {}).get("token_efficiency"), "{:.3f}") for m in methods]
                    + [_fmt(ms.get(m, {}).get("useful_fill"), "{:.3f}") for m in methods]
                    + [_fmt(d.get("token_efficiency_minus_length_grouped"), "{:+.3f}"),
                       _fmt(d.get("ratio_to_oracle"), "{:.3f}"), _fmt(d.get("order_spearman"), "{:+.2f}")])
    text = PLANNING_LEGEND + " order rho: Spearman rank correlation of a batch's position in the epoch with " \
        "its mean length (0: no drift).\n\n" + _table(header, rows, markdown)
    settings = planning.get("odb_default_window")
    if settings:
        text += f"\n\nodb-default window settings (ODBConfig fields): {_window_text(settings)}"
    same = {name: all(m.get("plan_stream_same_batches", True) for k, m in w["methods"].items()
                      if k.startswith("odb-")) for name, w in planning["workloads"].items()}
    differ = [n for n, ok in same.items() if not ok]
    text += ("\nodb rows: batches of ODBDataLoader itself; odb.plan.windows.window.plan_stream planned the same batches "
             + ("on every workload" if not differ else f"EXCEPT on {', '.join(differ)}"))
    return text


def short_epoch_table(planning: Dict[str, Any], markdown: bool = False) -> str:
    """Epochs of a few hundred to a few thousand samples per workload (seeded subsamples, means over the
    seeds): token efficiency of every sampler, odb-default against LengthGrouped (mean and worst seed) and
    the oracle, and how many samples odb reads before its first and tenth batch."""
    names = [m for m in ("fixed", "length_grouped", "batch_rebalance", "odb-default", "oracle")
             if any(m in e["methods"] for w in planning["workloads"].values()
                    for e in w.get("short_epochs", {}).values())]
    header = (["workload", "samples", "fixed B"] + [f"eff. {_SHORT_NAMES[m]}" for m in names]
              + ["odb - LG (mean)", "odb - LG (worst seed)", "step/cap LG", "step/cap odb", "odb useful fill / oracle",
                 "odb reads before batch 1", "before batch 10"])
    rows = []
    for name, w in planning["workloads"].items():
        for n, e in w.get("short_epochs", {}).items():
            ms = e["methods"]
            d = ms.get("odb-default", {})
            reads = e.get("odb_reads_before_batch", {})
            rows.append([name, n, "/".join(str(b) for b in sorted(set(e["fixed_batch_size"])))]
                        + [_fmt(ms.get(m, {}).get("token_efficiency"), "{:.3f}") for m in names]
                        + [_fmt(d.get("token_efficiency_minus_length_grouped"), "{:+.3f}"),
                           _fmt(e.get("worst_token_efficiency_minus_length_grouped"), "{:+.3f}"),
                           _fmt(ms.get("length_grouped", {}).get("useful_fill"), "{:.3f}"),
                           _fmt(d.get("useful_fill"), "{:.3f}"), _fmt(d.get("ratio_to_oracle"), "{:.3f}"),
                           _fmt(reads.get("1"), "{:.0f}"), _fmt(reads.get("10"), "{:.0f}")])
    if not rows:
        return "no short epochs in these results"
    seeds = next(e["seeds"] for w in planning["workloads"].values() for e in w.get("short_epochs", {}).values())
    return (f"Each row: means over {len(seeds)} seeded subsamples of the workload (odb at its defaults, through "
            "ODBDataLoader); these epochs never reach full windows. odb reads before batch k: samples the loader "
            "must have read before its k-th batch is planned (the first windows are small so that the first "
            "batch comes early).\n\n" + _table(header, rows, markdown))


def buffer_table(planning: Dict[str, Any], markdown: bool = False) -> str:
    """Per workload and odb setting: the loader's own buffer counters (odb_stats, where it has them), the
    peak samples/tokens read but not emitted (measured from outside), planning cost, and the samples read
    before the first and tenth batch."""
    header = ["workload", "odb", "buffered_max", "read_ahead_max", "read_ahead_tokens_max", "peak held samples",
              "peak held tokens", "windows", "plan us/sample", "plan CPU us/sample", "plan ms/window (max)",
              "reads before batch 1",
              "reads before batch 10", "plan_stream = loader"]
    rows = []
    for name, w in planning["workloads"].items():
        for k in _methods(w["methods"]):
            if not k.startswith("odb-"):
                continue
            m = w["methods"][k]
            rows.append([name, k, _fmt(m.get("buffered_max"), "{:d}"), _fmt(m.get("read_ahead_max"), "{:d}"),
                         _fmt(m.get("read_ahead_tokens_max"), "{:d}"), _fmt(m.get("peak_held_samples"), "{:d}"),
                         _fmt(m.get("peak_held_tokens"), "{:d}"), _fmt(m.get("windows"), "{:d}"),
                         _fmt(m.get("plan_us_per_sample"), "{:.1f}"), _fmt(m.get("plan_cpu_us_per_sample"), "{:.1f}"),
                         _fmt(m.get("window_plan_ms_max"), "{:.1f}"), _fmt(m.get("reads_before_batch_1"), "{:d}"), _fmt(m.get("reads_before_batch_10"), "{:d}"),
                         "yes" if m.get("plan_stream_same_batches") else "NO"])
    return _table(header, rows, markdown)


# ---- loader ------------------------------------------------------------------------------------
def _loader_regimes(loader: Dict[str, Any]) -> Dict[str, Any]:
    return loader.get("regimes") or {"tensor": loader}  # older results: one regime


def loader_table(loader: Dict[str, Any], markdown: bool = False) -> str:
    parts = []
    for name, reg in _loader_regimes(loader).items():
        header = ["loader", "samples", "samples/s", "CPU s (all procs)", "CPU ms/sample",
                  "training-thread CPU us/sample", "first batch s"]
        rows = []
        for arm, m in reg["median"].items():
            rows.append([arm, f"{m['samples']:.0f}", f"{m['samples_per_s']:.0f}", f"{m['cpu_s']:.2f}",
                         f"{1e3 * m['cpu_s'] / m['samples']:.3f}", _fmt(m.get("thread_cpu_us_per_sample"), "{:.1f}"),
                         f"{m['first_batch_s']:.3f}"])
        r, g, met = reg["ratios"], reg["goals"], reg["goals_met"]
        base = "plain replay" if "plain_replay" in reg["median"] else f"plain bs{reg.get('batch_size')}"
        title = (f"odb at {name} against a plain DataLoader replaying its {reg['batches']} batches "
                 f"(mean {reg['mean_batch_size']:.1f} samples)" if "batches" in reg else f"regime {name}")
        lines = [f"{'### ' if markdown else '-- '}{title}: {reg.get('description', '')}",
                 _table(header, rows, markdown), "",
                 f"odb / {base}: samples/s x{r['samples_per_s_ratio']:.2f} (goal >= {g['samples_per_s_ratio_min']}: "
                 f"{_met(met['samples_per_s_ratio'])}), CPU s x{r['cpu_s_ratio']:.2f} (goal <= {g['cpu_s_ratio_max']}: "
                 f"{_met(met['cpu_s_ratio'])}), first batch {r['first_batch_extra_s']:+.3f} s "
                 f"(goal <= +{g['first_batch_extra_s_max']}: {_met(met['first_batch_extra_s'])}); "
                 f"training-thread CPU per sample x{r.get('thread_cpu_ratio', float('nan')):.2f}", ""]
        parts.append("\n".join(lines))
    check = loader.get("declared_check")
    if check:
        sps = check["samples_per_s"]
        parts.append(
            f"{'### ' if markdown else '-- '}checking declared lengths= (known-lengths odb, {check['samples']} samples, "
            f"{check['num_workers']} workers, {check['repeats']} alternating epochs per arm): samples/s "
            f"{sps['checked']:.0f} checked, {sps['unchecked']:.0f} unchecked; cost {100 * check['cost']:.1f}% "
            f"(rounds {100 * check['cost_rounds'][0]:.1f} to {100 * check['cost_rounds'][1]:.1f}%; goal <= "
            f"{100 * check['goal_cost_max']:.0f}%: {_met(check['goal_met'])}); the check's CPU "
            f"{check['check_cpu_us_per_sample']:.2f} us per sample, {100 * check['check_cpu_share']:.2f}% of the "
            f"loader's CPU per sample\n")
    return "\n".join(parts)


# ---- training -----------------------------------------------------------------------------------
TRAIN_ARM_LABELS = {"fixed": "fixed", "group_by_length": "group_by_length", "batch_rebalance": "BatchRebalanceSampler",
                    "trl_packing": "TRL packing (bfd)", "odb_padded": "odb padded", "odb_packed": "odb packed",
                    "odb_padded_same_lr": "odb padded, fixed's lr"}


def _spread(t: Dict[str, float]) -> str:
    return f"{t['median']:.0f} ({t['min']:.0f}-{t['max']:.0f})"


def _training_part(part: Dict[str, Any], cap: int, rounds: int, markdown: bool) -> List[str]:
    mem = "peak MiB (cuda)" if any(a.get("peak_mib") for w in part["workloads"].values()
                                   for a in w["arms"].values()) else "saved MiB"
    header = ["arm", "attention", "steps/rank", "token eff.", "tokens/step / cap", "max step B x L", mem,
              "loader s", "other threads CPU s", "real tokens/s (min-max)", "odb padded x", "odb packed x"]
    out: List[str] = []
    for name, w in part["workloads"].items():
        scaling = f"lengths / {w['divided_by']}, " if w.get("divided_by", 1) != 1 else ""
        out.append(f"{'#### ' if markdown else '-- '}{name}: {w['source']}; {scaling}truncated at {w['truncation']}; "
                   f"{w['samples']} samples, mean {w['mean_length']:.0f}, max {w['max_length']}; cap {cap} padded "
                   f"tokens per micro-batch, fixed B={w['fixed_batch_size']}; {part['world']} process(es) x "
                   f"{part['threads']} thread(s), medians of {rounds} interleaved rounds")
        rows = []
        for arm, m in w["arms"].items():
            ratios = [w["odb_over"].get(o, {}).get(arm) for o in ("odb_padded", "odb_packed")]
            memory = m.get("peak_mib") if mem.startswith("peak") else m.get("saved_mib")
            rows.append([TRAIN_ARM_LABELS.get(arm, arm), m["attention"], str(m["steps"]),
                         f"{m['token_efficiency']:.3f}", f"{m['tokens_per_step_vs_cap']:.3f}",
                         str(m["max_step_padded_tokens"]), _fmt(memory, "{:.0f}"), _fmt(m.get("loader_s"), "{:.2f}"),
                         _fmt(m.get("other_threads_cpu_s"), "{:.2f}"), _spread(m["tokens_per_s"])]
                        + [_fmt(r, "x{:.2f}") for r in ratios])
        out += [_table(header, rows, markdown), ""]
        fit = w.get("step_cost")
        if fit:
            out += [f"step cost (rank 0, least squares over the {fit['steps_fitted']} steps of the padded arms, "
                    f"R^2 {fit['r2']:.2f}): {fit['per_step_ms']:.1f} ms per step + {fit['per_1k_tokens_ms']:.1f} ms "
                    f"per 1,000 padded tokens + {fit['attention_per_1k_tokens_x_1k_length_ms']:.2f} ms per 1,000 "
                    f"tokens x 1,000 row length: a step's fixed cost is worth {fit['per_step_in_tokens']:.0f} tokens",
                    ""]
        out += ["settings: " + "; ".join(f"{TRAIN_ARM_LABELS.get(a, a)}: {t}" for a, t in w["settings"].items()), ""]
    return out


def _ms(t: Optional[Dict[str, float]], spec: str = "{:.1f}") -> str:
    """median (min-max) of a spread, or '-' (an arm that did not get there in some round)."""
    if not t:
        return "-"
    return f"{spec.format(t['median'])} ({spec.format(t['min'])}-{spec.format(t['max'])})"


def convergence_intro(conv: Dict[str, Any]) -> str:
    m = conv.get("model") or {}
    return (f"Real text ({conv['workload']} lengths: {conv['samples']} samples, mean {conv['mean_length']:.0f} / max "
            f"{conv['max_length']} tokens), {conv['world']} gloo DDP ranks on CPU, a Llama of "
            f"{m.get('num_hidden_layers', '?')} layers x {m.get('hidden_size', '?')} hidden, memory cap "
            f"{conv['cap']:,} padded tokens per micro-batch, so the user's micro-batch is B = {conv['fixed_batch_size']} "
            f"(the largest whose longest sample fits) and an optimizer step holds G = B x A x {conv['world']} samples. "
            f"Every arm: the same samples per optimizer step (TRL packing as near as its rows allow), AdamW at the "
            f"same constant learning rate {conv['base_lr']:g}, the same initial weights, the loss of a step its token "
            f"mean over all micro-batches and ranks. {conv['epochs']} epochs each (+{conv['extra_epochs']} for an arm "
            f"not yet at the target); target = the fixed arm's final held-out loss in the same round; "
            f"{conv['rounds']} interleaved rounds (seeds 0-{conv['rounds'] - 1}): median (min-max). An arm whose "
            "every optimizer step holds fixed's samples (checked in the run: a digest of each step's tokens over "
            "all ranks) makes fixed's updates, and its curve differs from fixed's only by rounding that the training "
            "amplifies; its ratios (x fixed, x group_by_length, the goals) read its time at the step where fixed "
            "reached the target ('s at fixed's target step'); every other arm's read its own curve. Held-out: "
            f"{conv['held_out']['samples']} x {conv['held_out']['length']} tokens of unseen text; seconds exclude "
            "evaluation.")


def convergence_rows(part: Dict[str, Any]) -> Tuple[List[str], List[List[str]]]:
    header = ["arm", "samples / step", "optimizer steps", "micro-steps / step", "padding share", "real tokens/s",
              "s to target", "s at fixed's target step", "x fixed", "x group_by_length",
              f"loss at {part['equal_time_s']['median']:.1f} s",
              "loader wait s"]
    rows = []
    for arm, m in part["arms"].items():
        reached = m["reached"]
        ttt = _ms(m["time_to_target_s"]) if m["time_to_target_s"] else (
            f"not reached ({reached} of {len(part['rounds'])})" if "rounds" in part else "not reached")
        rows.append([CONVERGENCE_LABELS.get(arm, arm), f"{m['samples_per_step']:.1f}", str(m["steps"]),
                     f"{m['micro_steps_per_step']:.2f}", f"{m['padding_share']:.3f}", _ms(m["tokens_per_s"], "{:,.0f}"),
                     ttt, _ms(m.get("time_read_s")) if m.get("same_samples_as_fixed") else "-",
                     _fmt(m.get("time_vs_fixed"), "x{:.2f}"), _fmt(m.get("time_vs_group_by_length"), "x{:.2f}"),
                     _ms(m["loss_at_equal_time"], "{:.3f}"), _ms(m["loader_wait_s"], "{:.2f}")])
    return header, rows


CONVERGENCE_LABELS = {**LABELS, "odb_budget_filled": "odb budget-filled (not the same updates)"}


def convergence_table(conv: Dict[str, Any], markdown: bool = False) -> str:
    """The first table of ``make demo``: every arm at the user's samples per step, per accumulation A."""
    h = "### " if markdown else "-- "
    parts = [convergence_intro(conv), ""]
    for acc, part in conv["accumulations"].items():
        tgt = part["target_loss"]
        parts += [f"{h}A = {acc}: G = {part['global_batch_size']} samples per optimizer step; target loss "
                  f"{_ms(tgt, '{:.3f}')}, loss compared at {part['equal_time_s']['median']:.1f} s (the shortest arm's "
                  "training time)", ""]
        header, rows = convergence_rows(part)
        parts += [_table(header, rows, markdown), "",
                  f"settings (A = {acc}): " + "; ".join(f"{CONVERGENCE_LABELS.get(a, a)}: {m['settings']}"
                                                        for a, m in part["arms"].items()), ""]
    for g in conv.get("goals", []):
        line = f"goal: {g['goal']}: {_goal_measured(g)} (target {_goal_target(g)}): {_met(g['met'])}"
        if g.get("read_at_fixed_step"):
            read = ", ".join(CONVERGENCE_LABELS.get(a, a) for a in g["read_at_fixed_step"])
            line += (f" [read at fixed's target step for {read} (same samples as fixed in every step); each arm's own "
                     f"curve: {_fmt(g.get('own_curves'), '{:.2f}')}]")
        if not g["met"] and "gap" not in g:
            costs = conv.get("breakdowns", {}).get(str(g.get("accumulation")), conv.get("breakdown", {}))
            line += f"; breakdown (A = {g.get('accumulation', 8)}): " + "; ".join(
                _arm_cost(a, b) for a, b in ((a, costs.get(a)) for a in [*g.get("arms", []), *g.get("context", [])])
                if b)
            if g.get("bound"):
                line += "; " + _bound_text(g["bound"])
        parts.append(line)
    return "\n".join(parts)


def _bound_text(b: Dict[str, Any]) -> str:
    """A composition goal's bound (odb.bench.convergence.composition_bound) in words."""
    twin = "" if b.get("twin") is None else (f"; measured: {CONVERGENCE_LABELS.get(b['twin'], b['twin'])} (the same "
                                             f"steps, no padding, one micro-step) {b['measured']:.3f}")
    verdict = "within the goal" if b["reachable"] else "beyond the goal: no padded cut of these steps meets it"
    return (f"bound at zero padding and one micro-step per rank {b['bound']:.3f}, {verdict} (model: "
            f"{b['steps_ratio']:.3f}x group_by_length's steps to the target x its unpadded share "
            f"{b['unpadded_share']:.3f} = {b['model']:.3f}{twin})")


def _arm_cost(arm: str, b: Dict[str, Any]) -> str:
    """One arm's part of a missed convergence goal's breakdown: what its steps cost, when it reaches the target."""
    where = ""
    if b.get("target_step") is not None:
        whose = "its steps hold fixed's samples, which reach" if b.get("same_samples_as_fixed") else "its own steps reach"
        where = (f", {whose} the target at step {b['target_step']:.1f} of {b['steps']}, "
                 f"read {_fmt(b.get('time_read_s'), '{:.1f}')} s")
    return (f"{CONVERGENCE_LABELS.get(arm, arm)}: padding share {b['padding_share']:.3f}, "
            f"{b['micro_steps_per_step']:.2f} micro-steps per step at {b['ms_per_micro_step']:.0f} ms each, "
            f"loader wait {_fmt(b['loader_wait_s'], '{:.2f}')} s of {_fmt(b['train_s'], '{:.1f}')} s{where}")


def _goal_measured(g: Dict[str, Any]) -> str:
    if g.get("gap") is not None:
        return f"largest |loss gap| {g['gap']['max_gap']:.4f} over {g['gap']['steps_compared']} evaluated steps"
    return _fmt(g["measured"], "{:.2f}")


def _goal_target(g: Dict[str, Any]) -> str:
    if "gap" in g:
        gap = g.get("gap")
        return "<= fixed's spread over rounds at each step + 1e-4" + (
            "" if not gap else f" (worst step {gap['step']}: gap {gap['worst_gap']:.4f}, spread "
                               f"{gap['spread_there']:.4f})")
    return f"<= {g['target']}"


def training_table(training: Dict[str, Any], markdown: bool = False) -> str:
    if "ranks2" not in training and "ranks1" not in training:
        return "(results of an older benchmark: no per-rank training figures)"
    cap, rounds = training["cap"], training["rounds"]
    m = training["model"]
    parts = [f"Llama {m['num_hidden_layers']} layers x {m['hidden_size']} hidden, vocabulary {m['vocab_size']} "
             f"(byte tokens of real text), AdamW, {training['device']}; real tokens/s = non-pad tokens trained "
             "(all ranks) / epoch wall time, loading included; "
             + ("peak MiB = torch.cuda.max_memory_allocated over the arm's first epoch (parameters, gradients, "
                "optimizer state and activations)" if str(training["device"]).startswith("cuda") else
                "saved MiB = bytes autograd saves for backward on the largest step (parameters excluded)")
             + "; loader s = rank 0's seconds in next(loader); other threads CPU s = "
             "rank 0's CPU seconds outside the training thread (odb's batch thread, gloo)", ""]
    for key, title in (("ranks2", "2 gloo DDP ranks"), ("ranks1", "1 process")):
        if key in training:
            parts += [f"{'### ' if markdown else '== '}{title}", ""] + _training_part(training[key], cap, rounds,
                                                                                     markdown)
    return "\n".join(parts)


def _median_round(rounds: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The round whose fixed arm took the median training time (the first round without a fixed arm), drawn
    whole: arms of different rounds start from other weights and shuffles, so only one round compares."""
    if not rounds:
        return None
    if not all("fixed" in r["arms"] for r in rounds):
        return rounds[0]
    return sorted(rounds, key=lambda r: r["arms"]["fixed"]["train_s"])[len(rounds) // 2]


def plot_convergence(conv: Dict[str, Any], path: str) -> None:
    """Held-out loss against optimizer step and against training seconds (medians over rounds), per A."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accs = list(conv["accumulations"])
    fig, axes = plt.subplots(len(accs), 2, figsize=(12, 4.2 * len(accs)), squeeze=False)
    arms = list(next(iter(conv["accumulations"].values()))["arms"])
    colors = {a: f"C{k}" for k, a in enumerate(arms)}
    for row, acc in enumerate(accs):
        part = conv["accumulations"][acc]
        shown = _median_round(part.get("rounds") or [])
        for arm, m in part["arms"].items():
            pts = m["loss_by_step"]
            style = dict(color=colors[arm], marker=".", lw=1.2, ls="--" if arm == "odb_budget_filled" else "-",
                         label=CONVERGENCE_LABELS.get(arm, arm))
            axes[row][0].plot([p["step"] for p in pts], [p["median"] for p in pts], **style)
            axes[row][0].fill_between([p["step"] for p in pts], [p["min"] for p in pts], [p["max"] for p in pts],
                                      color=colors[arm], alpha=0.12)
            if shown is not None:  # every arm from the same round, the round's own target marked
                curve = shown["arms"][arm]["curve"]
                past = shown["arms"][arm].get("epochs_trained", conv["epochs"]) > conv["epochs"]
                label = CONVERGENCE_LABELS.get(arm, arm) + (f" (trained past {conv['epochs']} epochs)" if past else "")
                axes[row][1].plot([p["s"] for p in curve], [p["loss"] for p in curve], **dict(style, label=label))
                reached = shown["arms"][arm]["time_to_target_s"]
                if reached is not None:
                    axes[row][1].plot([reached], [shown["target_loss"]], marker="o", ms=7, mfc="none",
                                      color=colors[arm])
        tgt = part["target_loss"]["median"]
        axes[row][0].axhline(tgt, color="k", lw=0.8, ls=":",
                             label=f"target {tgt:.3f}: fixed's final loss (median over rounds)")
        if shown is not None:
            axes[row][1].axhline(shown["target_loss"], color="k", lw=0.8, ls=":",
                                 label=f"target {shown['target_loss']:.3f}: fixed's final loss in this round "
                                       f"(circles: where each arm reaches it)")
        for ax in axes[row]:
            ax.set_ylabel("held-out loss (nats per byte)")
        axes[row][0].set_xlabel(f"optimizer step (A = {acc}, G = {part['global_batch_size']} samples per step)")
        seed = f", seed {shown['seed']}" if shown is not None and "seed" in shown else ""
        axes[row][1].set_xlabel(f"training seconds (2 ranks, no evaluation; all arms: fixed's median round{seed})")
        axes[row][0].set_title(f"A = {acc}: loss per optimizer step (median, band: min-max of "
                               f"{conv['rounds']} rounds)", fontsize=10)
        axes[row][1].set_title(f"A = {acc}: loss against time", fontsize=10)
        axes[row][0].legend(fontsize=7)
        axes[row][1].legend(fontsize=7)
    fig.suptitle(f"Convergence at the user's settings: {conv['workload']}, {conv['samples']} samples, "
                 f"cap {conv['cap']:,}, B = {conv['fixed_batch_size']}, same learning rate", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ---- end to end ---------------------------------------------------------------------------------
def e2e_table(e2e: Dict[str, Any], markdown: bool = False) -> str:
    g = e2e["goals"]
    parts = [f"{e2e['samples']} samples (lengths mean {e2e['lengths']['mean']:.0f}, CV {e2e['lengths']['cv']:.2f}, "
             f"max {e2e['lengths']['max']}), sample cost {e2e['sample_cost']['mean_ms']:.2f} ms CPU on average, "
             f"{e2e['num_workers']} workers, budget {e2e['token_budget']}, {e2e.get('logical_cpus')} logical CPUs; "
             f"data time {e2e['data_s']:.2f} s (= {e2e['data_cpu_s']:.2f} CPU s measured in one process / "
             f"{e2e['num_workers']} workers); plain-fit and group_by_length B={e2e['plain_fit_batch_size']}, "
             f"plain-mean B={e2e['plain_mean_batch_size']}; every arm at its defaults; medians of {e2e['repeats']} "
             "(arms interleaved). compute s: the steps' nominal cost (seconds per padded token x padded tokens); "
             "step s: what they took; ideal = max(data time, compute s); overlap = epoch / ideal; "
             "switches: voluntary context switches of the main process (hand-offs between its threads)", ""]
    header = ["arm", "epoch s", "ideal s", "overlap", "loader wait s", "wait after 1st batch s", "first batch s",
              "compute s", "step s", "training-thread CPU s", "main CPU s", "workers CPU s", "CPU floor s", "switches",
              "steps", "mean B", "token eff.", "over budget"]
    for name, st in e2e["settings"].items():
        rows = []
        for arm, m in st["median"].items():
            rows.append([ARM_NAMES.get(arm, arm), f"{m['epoch_s']:.2f}", _fmt(m.get("ideal_s"), "{:.2f}"), f"{m['overlap']:.2f}",
                         f"{m['loader_wait_s']:.2f}", _fmt(m.get("wait_after_first_s"), "{:.2f}"),
                         f"{m['first_batch_s']:.3f}", f"{m['compute_s']:.2f}", _fmt(m.get("step_s"), "{:.2f}"),
                         f"{m['loader_cpu_s']:.2f}", _fmt(m.get("main_cpu_s"), "{:.2f}"),
                         _fmt(m.get("workers_cpu_s"), "{:.2f}"), _fmt(m.get("cpu_floor_s"), "{:.2f}"),
                         _fmt(m.get("main_switches"), "{:.0f}"), f"{m['steps']:.0f}",
                         f"{m['mean_batch_size']:.1f}", f"{m['token_efficiency']:.3f}",
                         f"{m['over_budget_batches']:.0f}"])
        met = st["goals_met"]
        o = st["median"]["odb"]
        line = (f"odb overlap {o['overlap']:.2f} (goal <= {g['overlap_max']}: {_met(met['overlap'])}); "
                f"odb epoch / plain-fit x{st['odb_vs_plain_fit']:.3f}, / plain-mean x{st['odb_vs_plain_mean']:.3f}")
        if "odb_vs_length_grouped" in st:
            line += f", / group_by_length x{st['odb_vs_length_grouped']:.3f}"
        if "faster_than_plain_fit" in met:
            line += (f" (goal < 1 vs plain-fit: {_met(met['faster_than_plain_fit'])}; "
                     f"vs plain-mean: {_met(met['faster_than_plain_mean'])})")
        else:
            line += (f" (goal <= {g['data_bound_slowdown_max']} vs plain-fit: {_met(met['vs_plain_fit'])}; "
                     f"vs plain-mean: {_met(met['vs_plain_mean'])})")
        step = {"gil": "a pure-Python loop holding the GIL", "sleep": "a sleep (releases the GIL)"}.get(
            st.get("step", "sleep"), st.get("step"))
        parts += [f"{'### ' if markdown else '-- '}{name} (compute of a padding-free plan = {st['ratio']} x data time; "
                  f"step: {step})", _table(header, rows, markdown), "", line, ""]
    return "\n".join(parts)


# ---- packed layout --------------------------------------------------------------------------------
def packing_tables(pk: Dict[str, Any], markdown: bool = False) -> str:
    fill = pk["fill"]
    header = ["workload", "mean len", "rows: odb-packed", "trl-bfd", "fixed-count (B)", "bound",
              "fill: odb-packed", "trl-bfd", "fixed-count", "odb - trl", "trl cut tokens", "odb plan us/sample"]
    rows = []
    for name, w in fill["workloads"].items():
        o, t, f = w["odb-packed"], w["trl-bfd"], w["fixed-count"]
        rows.append([name, f"{w['mean_length']:.0f}", str(o["rows"]), str(t["rows"]), f"{f['rows']} ({f['batch_size']})",
                     str(w["bound_rows"]), f"{o['fill']:.3f}", f"{t['fill']:.3f}", f"{f['fill']:.3f}",
                     f"{w['odb_minus_trl']:+.3f}", str(t["cut_tokens"]), f"{o['plan_us_per_sample']:.1f}"])
    parts = [f"Rows of {fill['token_budget']} tokens; useful fill = real tokens / (rows x budget); bound = "
             "ceil(tokens / budget)", _table(header, rows, markdown)]
    tr = pk.get("training")
    if tr:
        head = ["arm", "attention", "steps", "samples/step", "real tokens/s", "token eff.", "final loss"]
        attn = tr.get("attn", {})
        trows = [[a, attn.get(a, "sdpa"), str(tr[a]["steps"]), f"{tr[a]['mean_batch_size']:.1f}",
                  f"{tr[a]['real_tokens_per_s']:.0f}", f"{tr[a]['token_efficiency']:.3f}", f"{tr[a]['final_loss']:.3f}"]
                 for a in tr["arms"]]
        parts += ["", f"Training ({tr['device']}, {tr['samples']} samples, budget {tr['token_budget']}, "
                      f"fixed-count B={tr['fixed_batch_size']})", _table(head, trows, markdown), "",
                  "odb-packed real tokens/s / " + ", ".join(f"{k} x{v:.2f}" for k, v in tr["vs"].items())]
    return "\n".join(parts)


def packing_goals(pk: Dict[str, Any]) -> List[Tuple[str, str, str, Optional[bool]]]:
    g = pk["goals"]
    out: List[Tuple[str, str, str, Optional[bool]]] = []
    for name, w in pk["fill"]["workloads"].items():
        f = w["odb-packed"]["fill"]
        out.append((f"packed {name}: odb useful fill", f"{f:.3f}", f">= {g['fill_min']}", f >= g["fill_min"]))
        out.append((f"packed {name}: odb fill - TRL bfd fill", f"{w['odb_minus_trl']:+.3f}",
                    f">= -{g['vs_trl_max_gap']}", w["odb_minus_trl"] >= -g["vs_trl_max_gap"]))
    tr = pk.get("training")
    if tr:
        out.append((f"packed training ({tr['device']}): real tokens/s, odb packed / odb padded",
                    f"{tr['packed_vs_padded']:.2f}", ">= 1", tr["packed_vs_padded"] >= 1.0))
    return out


# ---- ranks --------------------------------------------------------------------------------------
def ranks_table(ranks: Dict[str, Any], markdown: bool) -> str:
    if "error" in ranks:
        return f"skipped: {ranks['error']}"
    rows = [[name, w["steps"], f"{w['imbalance_mean']:.3f}", f"{w['imbalance_p95']:.3f}",
             f"{w['ghost_fraction_max']:.4f}", f"{w['useful_fill']:.3f}", w["split_groups"]]
            for name, w in ranks["workloads"].items()]
    head = ["workload", "steps/rank", "imbalance mean", "imbalance p95", "ghost fraction", "useful fill", "splits"]
    return _table(head, [[str(c) for c in row] for row in rows], markdown) + (
        f"\nalignment: {ranks['align_ms_per_window']:.3f} ms per window at "
        f"{ranks['align_world']} simulated ranks (pure planning, one rank)")


# ---- scale ----------------------------------------------------------------------------------------
SCALE_LEGEND = (
    "Every arm: G = s x W samples per optimizer step (s per rank), the same memory cap, a micro-batch costing its "
    "padded tokens + the overhead (micro_batch_cost). DDP step efficiency = (real tokens of the step / W + "
    "overhead) / (the slowest rank's padded tokens + its micro-batches x overhead), a ghost micro-batch costing "
    "the overhead alone; FSDP: the same over the sum over micro-steps of the costliest rank's micro-batch + "
    "overhead; bound = (real / W + overhead) / max(real / W + overhead, longest sample + overhead): the best any "
    "plan could do, below 1 where the step's longest sample outweighs a rank's share (of the steps of fixed and "
    "the odb arms, which hold the same samples: the next s of each rank's DistributedSampler order); with the "
    "cap: the same with the micro-batches the cap forces, (real / W + overhead) / (max(real / W, longest) + "
    "ceil(ceil(real / cap) / W) x overhead), what no plan within the cap beats. Each arm's "
    "cell: DDP median over the steps (p10-p90) / FSDP median; n/a: the arm is not in the installed odb.")


def _scale_cell(arm: Dict[str, Any]) -> str:
    """An arm's cell: DDP median (p10-p90) / FSDP median."""
    if "ddp" not in arm:
        if arm.get("skipped"):
            return "not run"
        return "n/a" if arm.get("available") is False else ("error" if arm else "-")
    d, f = arm["ddp"], arm["fsdp"]
    return f"{d['median']:.3f} ({d['p10']:.3f}-{d['p90']:.3f}) / {f['median']:.3f}"


def scale_table(scale: Dict[str, Any], markdown: bool = False) -> str:
    """The scale section (odb.bench.scale): per workload, rows world x s, each arm's DDP and FSDP step
    efficiency and the bound; then its notes and goals."""
    if "error" in scale:
        return f"skipped: {scale['error']}"
    h = "### " if markdown else "-- "
    labels = scale.get("arm_labels", {})
    arms = scale["arms"]
    parts = [SCALE_LEGEND, ""]
    header = ["world", "s/rank", "G", "steps"] + [labels.get(a, a) for a in arms] + ["bound / with the cap"]
    for name, w in scale["workloads"].items():
        parts.append(f"{h}{name}: {w['source']}, {w['samples']} samples clipped to {scale['length_range'][0]}.."
                     f"{scale['length_range'][1]} (mean {w['mean_length']:.0f}, {100 * w['share_at_max_length']:.0f}% "
                     f"at {scale['length_range'][1]}); cap {scale['token_budget']} tokens, overhead "
                     f"{scale['micro_batch_cost']} tokens")
        rows, errors, over, biggest, sources, fewer = [], [], [], 0, {}, []
        for cell in w["cells"].values():
            a = cell["arms"]
            rows.append([str(cell["world"]), str(cell["share"]), str(cell["global_batch_size"]), str(cell["steps"])]
                        + [_scale_cell(a.get(k, {})) for k in arms]
                        + [_fmt((cell.get("bound") or {}).get("median"), "{:.3f}") + " / "
                           + _fmt((cell.get("cap_bound") or {}).get("median"), "{:.3f}")])
            errors += [f"{labels.get(k, k)} at {cell['world']}x{cell['share']}: {m['error']}" for k, m in a.items()
                       if m.get("error") and m.get("available") is not False]
            br = a.get("batch_rebalance", {})
            if "over_cap_share" in br:
                over.append(br["over_cap_share"])
                biggest = max(biggest, br["max_micro_batch_tokens"])
            fewer += [f"{labels.get(k, k)} ran {m['steps']} of {cell['steps']} steps at {cell['world']}x{cell['share']}"
                      + (f" (its own plan of one step: {m['plan_s_per_step']:.1f} s, on every rank)"
                         if "plan_s_per_step" in m else "")
                      for k, m in a.items() if "steps" in m and m["steps"] < cell["steps"]]
            skipped = [k for k, m in a.items() if m.get("skipped")]
            if skipped:
                fewer.append(f"not run at {cell['world']}x{cell['share']}: "
                             + "; ".join(f"{labels.get(k, k)} ({a[k]['skipped']})" for k in skipped))
            for k in ("odb_global", "odb_global_packed"):
                if a.get(k, {}).get("source"):
                    sources.setdefault(a[k]["source"], []).append(f"{cell['world']}x{cell['share']}")
        parts += [_table(header, rows, markdown), ""]
        if over:
            parts.append(f"BatchRebalanceSampler knows no memory cap: {100 * float(sum(over) / len(over)):.1f}% of its "
                         f"micro-batches (mean over cells) exceed {scale['token_budget']} padded tokens, the largest "
                         f"{biggest} ({biggest / scale['token_budget']:.2f} x the cap).")
        parts += fewer
        pairs = [(c, c["paired"]["odb_global_minus_batch_rebalance"]) for c in w["cells"].values()
                 if "odb_global_minus_batch_rebalance" in c.get("paired", {})]
        if pairs:
            lo, hi = min(pairs, key=lambda p: p[1]["median"]), max(pairs, key=lambda p: p[1]["median"])
            parts.append(f"On the same steps (BatchRebalanceSampler(shuffle=False) over the samples of odb's steps, "
                         f"step by step): odb global padded - BatchRebalance, DDP, median per cell "
                         f"{lo[1]['median']:+.3f} ({lo[0]['world']}x{lo[0]['share']}) to {hi[1]['median']:+.3f} "
                         f"({hi[0]['world']}x{hi[0]['share']}); odb below it in "
                         f"{sum(p['steps_below'] for _, p in pairs)} of {sum(p['steps'] for _, p in pairs)} steps.")
        if sources:
            parts.append("odb global arms' source: " + "; ".join(f"{src}: {', '.join(sorted(set(cells)))}"
                                                               for src, cells in sources.items()))
        parts += [f"error: {e}" for e in errors] + [""]
    plan = scale.get("planning") or {}
    for layout, t in plan.items():
        if "ms_median" in t:
            parts.append(f"plan_global_step ({layout}) at {t['world']} ranks x {t['share']} samples: "
                         f"{t['ms_median']:.1f} ms per step (max {t['ms_max']:.1f}; CPU {t['cpu_ms_median']:.1f}), "
                         f"median of {t['repeats']}")
        else:
            parts.append(f"plan_global_step ({layout}): {t.get('error')}")
    if "meshes" in scale:
        from odb.bench.scale_mesh import mesh_lines

        parts += [""] + mesh_lines(scale["meshes"])
    parts += ["", "notes:"] + [f"- {n}" for n in scale.get("notes", [])]
    walls = scale.get("wall_s", {})
    if "total" in walls:
        parts.append(f"- section wall time {walls['total']:.0f} s")
    return "\n".join(parts)


def plot_scale(scale: Dict[str, Any], path: str, workload: str = "sharegpt") -> None:
    """scale.png: DDP step efficiency against world size (log x), one panel per samples per rank, one line per
    arm (band: p10-p90 over steps), the bounds dotted; for ``workload`` (the first one if absent)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "error" in scale or not scale.get("workloads"):
        return
    name = workload if workload in scale["workloads"] else next(iter(scale["workloads"]))
    cells = list(scale["workloads"][name]["cells"].values())
    shares = sorted({c["share"] for c in cells})
    labels = scale.get("arm_labels", {})
    fig, axes = plt.subplots(1, len(shares), figsize=(4.6 * len(shares), 4.4), squeeze=False, sharey=True)
    lowest = 1.0
    for ax, share in zip(axes[0], shares):
        row = sorted((c for c in cells if c["share"] == share), key=lambda c: c["world"])
        worlds = [c["world"] for c in row]
        for k, arm in enumerate(scale["arms"]):
            pts = [(c["world"], c["arms"][arm]["ddp"]) for c in row if "ddp" in c["arms"].get(arm, {})]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            lowest = min(lowest, min(p[1]["p10"] for p in pts))
            style = dict(color=f"C{k}", marker="o", ms=4, lw=1.4, ls="--" if arm.endswith("packed") else "-")
            ax.plot(xs, [p[1]["median"] for p in pts], label=labels.get(arm, arm), **style)
            ax.fill_between(xs, [p[1]["p10"] for p in pts], [p[1]["p90"] for p in pts], color=f"C{k}", alpha=0.08)
        for key, style, text in (("bound", dict(color="k", ls=":"), "bound (longest sample)"),
                                 ("cap_bound", dict(color="0.45", ls="-."), "bound with the cap's micro-batches")):
            pts = [(c["world"], c[key]["median"]) for c in row if c.get(key)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1, label=text, **style)
        ax.set_xscale("log")
        ax.set_xticks(worlds)
        ax.set_xticklabels([f"{w:,}" for w in worlds], fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("world size (ranks)")
        ax.set_title(f"{share} sample(s) per rank per step", fontsize=10)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("DDP step efficiency (median over steps)")
    axes[0][0].set_ylim(max(0.0, min(0.5, lowest - 0.05)), 1.02)
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, fontsize=8, ncol=5, loc="lower center", frameon=False)
    fig.suptitle(f"Step efficiency against world size: {name}, G = s x W samples per step, cap "
                 f"{scale['token_budget']} tokens, overhead {scale['micro_batch_cost']} per micro-batch", fontsize=11)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- goals --------------------------------------------------------------------------------------
def goals(results: Dict[str, Any]) -> List[Goal]:
    """(goal, measured, target, met, straddles) for every goal the results hold; ``straddles``: the rounds'
    min-max of the measured ratio lies on both sides of the target (odb.bench.verdict)."""
    out: List[Goal] = []
    for g in (results.get("convergence") or {}).get("goals", []):
        out.append(Goal(g["goal"], _goal_measured(g) + spread_text(g.get("spread")), _goal_target(g), g["met"],
                        bool(g.get("straddles"))))
    e2e = results.get("e2e")
    if e2e:
        g = e2e["goals"]
        for name, st in e2e["settings"].items():
            o, met = st["median"]["odb"], st["goals_met"]
            out.append((f"end to end, {name}: odb epoch / max(data time, compute)", f"{o['overlap']:.2f}",
                        f"<= {g['overlap_max']}", met["overlap"]))
            if "faster_than_plain_fit" in met:
                out.append((f"end to end, {name}: odb epoch / plain-fit epoch", f"{st['odb_vs_plain_fit']:.3f}",
                            "< 1", met["faster_than_plain_fit"]))
            else:
                out.append((f"end to end, {name}: odb epoch / plain-fit epoch", f"{st['odb_vs_plain_fit']:.3f}",
                            f"<= {g['data_bound_slowdown_max']}", met["vs_plain_fit"]))
                out.append((f"end to end, {name}: odb epoch / plain-mean epoch", f"{st['odb_vs_plain_mean']:.3f}",
                            f"<= {g['data_bound_slowdown_max']}", met["vs_plain_mean"]))
    planning = results.get("planning")
    if planning:
        out += planning_goals(planning)
    loader = results.get("loader")
    if loader:
        for name, reg in _loader_regimes(loader).items():
            r, g, met = reg["ratios"], reg["goals"], reg["goals_met"]
            base = ("plain replay of its batches" if "plain_replay" in reg["median"]
                    else f"plain bs{reg.get('batch_size')}")
            out.append((f"loader ({name}): samples/s, odb / {base}",
                        f"{r['samples_per_s_ratio']:.2f}", f">= {g['samples_per_s_ratio_min']}",
                        met["samples_per_s_ratio"]))
            out.append((f"loader ({name}): CPU s of all processes, odb / plain", f"{r['cpu_s_ratio']:.2f}",
                        f"<= {g['cpu_s_ratio_max']}", met["cpu_s_ratio"]))
            out.append((f"loader ({name}): time to first batch, odb - plain", f"{r['first_batch_extra_s']:+.3f} s",
                        f"<= +{g['first_batch_extra_s_max']} s", met["first_batch_extra_s"]))
        check = loader.get("declared_check")
        if check:
            out.append(("loader: checking declared lengths=, share of samples/s lost", f"{100 * check['cost']:.1f}%",
                        f"<= {100 * check['goal_cost_max']:.0f}%", check["goal_met"]))
    if results.get("packing"):
        out += packing_goals(results["packing"])
    for g in (results.get("training") or {}).get("goals", []):
        out.append(Goal(g["goal"], f"{g['measured']:.2f}" + spread_text(g.get("spread")), f">= {g['target']}",
                        g["met"], bool(g.get("straddles"))))
    if results.get("auto_budget"):
        from odb.bench.auto_budget import goal_rows

        out += goal_rows(results["auto_budget"])
    for g in (results.get("scale") or {}).get("goals", []):
        out.append((g["goal"], g["measured"], g["target"], g["met"]))
    for g in (results.get("rl_update") or {}).get("goals", []):
        out.append(Goal(g["goal"], g["measured"], g["target"], g["met"], bool(g.get("straddles"))))
    return [g if isinstance(g, Goal) else Goal(*g) for g in out]


# Window goals: odb-default's useful fill / the oracle's on every workload (a lower bar for heavy tails),
# its token efficiency against LengthGroupedSampler's (full and short epochs), the rank correlation of its
# emitted order with length, planning time per sample at the default window.
FILL_MIN, HEAVY_TAIL_FILL_MIN, HEAVY_TAILED, PLAN_US_MAX = 0.97, 0.95, ("pareto",), 10.0
ORDER_RHO_FLOOR = 0.1


def order_rho_max(steps: int) -> float:
    """Bound on |rank correlation| of batch order with length: what a random order of ``steps`` batches
    stays under at 3 standard deviations (1 / sqrt(steps - 1) each), and never less than 0.1."""
    return max(ORDER_RHO_FLOOR, 3.0 / max(steps - 1, 1) ** 0.5)


def _vs_grouped(methods: Dict[str, Any]) -> Tuple[str, Optional[bool]]:
    d, g, o = methods.get("odb-default"), methods.get("length_grouped"), methods.get("oracle")
    if not d or not g:
        return "-", None
    text = f"{d['token_efficiency']:.3f} vs {g['token_efficiency']:.3f}"
    if o and o["token_efficiency"] < g["token_efficiency"]:
        text += f" (oracle {o['token_efficiency']:.3f}: below LengthGrouped too)"
    return text, d["token_efficiency"] >= g["token_efficiency"]


def planning_goals(planning: Dict[str, Any]) -> List[Tuple[str, str, str, Optional[bool]]]:
    out: List[Tuple[str, str, str, Optional[bool]]] = []
    for name, w in planning["workloads"].items():
        d = w["methods"].get("odb-default")
        if not d:
            continue
        floor = HEAVY_TAIL_FILL_MIN if name.startswith(HEAVY_TAILED) else FILL_MIN
        ratio = d.get("ratio_to_oracle")
        # CPU time of the planning thread: the machine may be shared, and waiting for a core is not planning cost
        us = d.get("plan_cpu_us_per_sample", d.get("plan_us_per_sample"))
        if ratio is not None:
            out.append((f"window {name}: odb-default useful fill / oracle", f"{ratio:.3f}", f">= {floor}",
                        ratio >= floor))
        text, ok = _vs_grouped(w["methods"])
        if ok is not None:
            out.append((f"window {name}: odb-default token efficiency vs LengthGroupedSampler", text, ">=", ok))
        for n, e in w.get("short_epochs", {}).items():
            text, ok = _vs_grouped(e["methods"])
            if ok is not None:
                out.append((f"short epoch {name} ({n} samples): odb-default token efficiency vs LengthGrouped",
                            text, ">=", ok))
        rho = d.get("order_spearman")
        if rho is not None:
            bound = order_rho_max(d["steps"])
            out.append((f"order {name}: |rank correlation| of odb-default's batch order with length",
                        f"{rho:+.2f} ({d['steps']} steps)", f"<= {bound:.2f}", abs(rho) <= bound))
        if us is not None:
            out.append((f"planning {name}: CPU us per sample at the default window", f"{us:.1f}",
                        f"<= {PLAN_US_MAX:g}", us <= PLAN_US_MAX))
    return out


def goals_table(results: Dict[str, Any], markdown: bool = False) -> str:
    rows = [[g.goal, g.measured, g.target, verdict(g.met, g.straddles)] for g in goals(results)]
    return _table(["goal", "measured", "target", ""], rows, markdown)


def render(results: Dict[str, Any], markdown: bool = False) -> str:
    h = "## " if markdown else "== "
    parts = []
    if goals(results):
        parts += [f"{h}Goals", goals_table(results, markdown), ""]
    if results.get("convergence"):
        parts += [f"{h}Convergence at the user's settings (time to a model)",
                  convergence_table(results["convergence"], markdown), ""]
    if "planning" in results:
        parts += [f"{h}Planner quality (token efficiency and tokens per step, every sampler)",
                  summary_table(results["planning"], markdown=markdown), "",
                  f"{h}Short epochs (the first windows' ramp-up)", short_epoch_table(results["planning"], markdown),
                  "", f"{h}odb buffers and planning cost", buffer_table(results["planning"], markdown), "",
                  f"{h}Planner details", planning_tables(results["planning"], markdown)]
    if "ranks" in results:
        r = results["ranks"]
        parts += [f"{h}Ranks ({r.get('world', '?')} simulated, buffer {r.get('buffer_size', '?')})",
                  ranks_table(r, markdown), ""]
    if results.get("scale"):
        parts += [f"{h}Scale: step efficiency against world size (the user's samples per step)",
                  scale_table(results["scale"], markdown), ""]
    if "loader" in results:
        parts += [f"{h}Loader cost (medians of {results['loader']['repeats']})",
                  loader_table(results["loader"], markdown)]
    if "training" in results:
        parts += [f"{h}Training ({results['training']['device']})", training_table(results["training"], markdown),
                  ""]
    if "e2e" in results:
        parts += [f"{h}End to end", e2e_table(results["e2e"], markdown)]
    if "packing" in results:
        parts += [f"{h}Packed layout (padding-free rows)", packing_tables(results["packing"], markdown), ""]
    if results.get("auto_budget"):
        parts += [f"{h}token_budget=\"auto\" under a memory cap", auto_budget_table(results["auto_budget"], markdown), ""]
    if results.get("vlm_training"):
        parts += [f"{h}Vision-language training (Qwen2-VL, LLaVA)", vlm_table(results["vlm_training"], markdown), ""]
    if results.get("rl_update"):
        parts += [f"{h}GRPO policy update (TRL's GRPOTrainer, odb.integrations.trl.enable_odb)",
                  rl_update_table(results["rl_update"], markdown), ""]
    return "\n".join(parts)


def vlm_intro(vlm: Dict[str, Any]) -> str:
    m = vlm["model"]
    return (f"Tiny vision-language models built from configs (text decoder {m['layers']} layers x {m['hidden']} "
            f"hidden, random weights) with their real processors; chat samples processed alone, about half with 1-2 "
            f"noise images of sides {vlm['sides'][0]}-{vlm['sides'][1]} px (Qwen2-VL: image tokens and vision "
            f"patches grow with the size; LLaVA resizes every image to one size). 1 process, {vlm['threads']} "
            f"thread, AdamW lr {vlm['lr']:g}; every arm trains G = B x A samples per optimizer step with the step's "
            f"token-mean loss; one memory cap: the token cap (padded tokens per micro-batch, B the largest whose "
            f"longest sample fits) and a patch cap of B x the most patches of one sample; median (min-max) of "
            f"{vlm['rounds']} interleaved rounds. real tokens/s = non-pad tokens (image tokens included) / epoch "
            f"wall time; patches/s = image patches through the vision tower / epoch wall time. TRL's SFTTrainer is "
            f"no arm of its own: TRL 1.16 refuses packing and padding-free rows for vision datasets, so it trains "
            f"the padded batches of the fixed (its default) or group_by_length arm.")


def vlm_table(vlm: Dict[str, Any], markdown: bool = False) -> str:
    """The vision-language training section (odb.bench.vlm_training): every arm per workload, and the worst case."""
    from odb.bench.vlm_training import LABELS as VLM_LABELS

    h = "### " if markdown else "-- "
    parts = [vlm_intro(vlm), ""]
    header = ["arm", "attention", "optimizer steps", "micro-steps", "samples / step", "padding share",
              "max tokens / cap", "max patches / cap", "real tokens/s", "vision patches/s", "odb padded x",
              "odb packed x"]
    for name, w in vlm["workloads"].items():
        spi = w.get("patches_per_image_sample") or {}
        parts += [f"{h}{name}: {w['samples']} samples ({100 * w['image_share']:.0f}% with images, "
                  f"{spi.get('min', 0)}-{spi.get('max', 0)} patches per sample with images), mean {w['mean_length']:.0f} / max "
                  f"{w['max_length']} tokens; cap {w['token_budget']} tokens and {w['max_image_patches']} patches "
                  f"per micro-batch, B = {w['batch_size']}, A = {w['accumulation']}, G = {w['global_batch_size']}", ""]
        rows = []
        for arm, m in w["arms"].items():
            sps = m["samples_per_step"]
            rows.append([VLM_LABELS.get(arm, arm), m["attention"], str(m["steps"]), str(m["micro_steps"]),
                         f"{sps['min']}-{sps['max']}" if sps["min"] != sps["max"] else str(sps["min"]),
                         f"{m['padding_share']:.3f}", f"{m['max_micro_batch_tokens']} / {w['token_budget']}",
                         f"{m['max_micro_batch_patches']} / {w['max_image_patches']}",
                         _ms(m["tokens_per_s"], "{:,.0f}"), _ms(m["patches_per_s"], "{:,.0f}")]
                        + [_fmt(w["odb_over"][o].get(arm), "x{:.2f}") for o in ("odb_padded", "odb_packed")])
        parts += [_table(header, rows, markdown), "",
                  "settings: " + "; ".join(f"{VLM_LABELS.get(a, a)}: {t}" for a, t in w["settings"].items()), ""]
    parts.append("worst case, each odb arm's lowest ratio of real tokens/s over a baseline: " + "; ".join(
        f"{VLM_LABELS.get(o, o)} x{w['ratio']:.2f} {VLM_LABELS.get(w['baseline'])} ({w['workload']})"
        for o, w in vlm["worst"].items()))
    return "\n".join(parts)


def auto_budget_table(ab: Dict[str, Any], markdown: bool = False) -> str:
    """The auto-budget section: its settings, the table of every arm and the goal lines (odb.bench.auto_budget)."""
    from odb.bench.auto_budget import goal_lines, table

    head = (f"{ab['samples']} samples per workload, {ab['repeats']} repeat(s) (medians, min-max), tiny Llama "
            f"(hidden {ab['model']['hidden_size']}, {ab['model']['num_hidden_layers']} layers), float32 on CPU, memory = "
            f"ActivationMeter bytes; cap = {ab['cap_rule']}; auto arm: {ab['auto_mode']}; warm-up "
            f"{ab['warmup_steps']} steps.")
    text = table(ab["cases"])  # markdown already
    if not markdown:
        text = "\n".join(line for line in text.split("\n") if not line.startswith("|---"))
    return "\n".join([head, "", text, "", *("- " + line for line in goal_lines(ab["cases"]))])


def _rl_spread(t: Dict[str, float], spec: str = "{:.2f}") -> str:
    return f"{spec.format(t['median'])} ({spec.format(t['min'])}-{spec.format(t['max'])})"


def _rl_update_rows(u: Dict[str, Any], labels: Dict[str, str], budget: int, markdown: bool) -> str:
    """The arms of one rl_update policy-update run as a table."""
    rows = []
    for arm, a in u["arms"].items():
        if "ratios" in u:
            ratio = f"x{u['ratios'][arm]:.2f}" + ("" if arm == "trl" else spread_text(u["ratio_spreads"][arm]))
        else:  # a results file from before the packed arm
            ratio = "x1.00" if arm == "trl" else f"x{u['ratio']:.2f}" + spread_text(u.get("ratio_spread"))
        rows.append([labels.get(arm, arm), f"{a['micro_steps_per_step']:.2f}", f"{a['padding_share']:.3f}",
                     f"{a['prompt_padding_share']:.3f}", f"{a['max_micro_batch_tokens']} / {budget}",
                     _rl_spread(a["update_s"]), ratio])
    return _table(["arm", "micro-steps / step", "padding share", "of which prompt padding",
                   "largest micro-batch / cap", "update s / step", "x TRL"], rows, markdown)


def rl_update_table(rl: Dict[str, Any], markdown: bool = False) -> str:
    """The rl_update section (odb.bench.rl_update): the policy update of both arms at equal rollouts, the
    planning-only comparison per simulated world size, and the notes."""
    if "error" in rl:
        return f"skipped: {rl['error']}"
    h = "### " if markdown else "-- "
    u = rl["update"]
    budget, labels = u["settings"]["budget"], rl.get("arm_labels", {})
    parts = [f"{h}Policy update at equal rollouts ({u['world']} gloo process(es); cap {budget} padded tokens per "
             "micro-batch)", ""]
    run = rl.get("run")  # a section run on its own and merged into the results file (its command, commit, date)
    if run:
        parts[1:1] = [f"From `{run['command']}` (odb at commit {str(run.get('commit'))[:10]}, {run.get('date')}, "
                      f"{run.get('wall_s', 0.0):.0f} s, load average {run.get('load')}), merged into this results "
                      f"file.", ""]
    parts += [_rl_update_rows(u, labels, budget, markdown), ""]
    for name, v in (rl.get("updates") or {}).items():  # the update's variants (vLLM-style rollouts, bnpo)
        parts += [f"{h}Policy update, {rl.get('variant_labels', {}).get(name, name)} ({v['world']} gloo "
                  f"process(es))", "", _rl_update_rows(v, labels, budget, markdown), ""]
    pl = rl.get("planning") or {}
    for w, cell in pl.get("worlds", {}).items():
        parts += [f"{h}Planning only: {w} simulated ranks, {cell['steps']} step(s) (median (min-max) over steps)", ""]
        rows = []
        for arm, a in cell["arms"].items():
            label = pl["arm_labels"].get(arm, arm) + (" - planned only" if arm in pl["planned_only"] else "")
            rows.append([label, "yes" if pl["moves_rows"].get(arm) else "no", _rl_spread(a["ddp"], "{:.3f}"),
                         f"{a['fsdp']['median']:.3f}", f"{a['padding_share']['median']:.3f}",
                         f"{a['micro_steps']['median']:.1f}", _rl_spread(a["plan_ms"], "{:.1f}")])
        parts += [_table(["arm", "moves rows", "DDP step eff.", "FSDP", "padding share", "micro-steps", "plan ms"],
                         rows, markdown), ""]
    losses = pl.get("loss_types") or {}
    if losses:
        worlds = list(losses)
        parts += [f"{h}Planning only, per loss type: the plan enable_odb takes (step_plan='auto') and its DDP step "
                  f"efficiency, padded / packed (median over steps)", ""]
        rows = [[loss, first["step_plan"]] + [f"{losses[w][loss]['padded']['median']:.3f} / "
                                              f"{losses[w][loss]['packed']['median']:.3f}" for w in worlds]
                for loss, first in losses[worlds[0]].items()]
        parts += [_table(["loss", "step plan"] + [f"{w} ranks" for w in worlds], rows, markdown), ""]
    parts += ["notes:"] + [f"- {n}" for n in rl.get("notes", [])]
    if "total" in rl.get("wall_s", {}):
        parts.append(f"- section wall time {rl['wall_s']['total']:.0f} s")
    return "\n".join(parts)


# ---- plots --------------------------------------------------------------------------------------
def plot_step_metrics(loader: Dict[str, Any], path: str) -> None:
    """Per-step metrics of one odb epoch (batch size, padding, buffer occupancy, loader wait)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    regimes = _loader_regimes(loader)
    name = "tensor" if "tensor" in regimes else next(iter(regimes))
    reg = regimes[name]
    series = reg.get("odb_step_metrics") or {}
    keys = [k for k in ("batch_size", "padding_ratio", "buffered_samples", "loader_wait_ms") if k in series]
    if not keys:
        return
    fig, axes = plt.subplots(len(keys), 1, figsize=(9, 1.8 * len(keys)), sharex=True, squeeze=False)
    for ax, key in zip(axes[:, 0], keys):
        ax.plot(series[key], lw=0.8)
        ax.set_ylabel(key.replace("_", " "))
    axes[-1, 0].set_xlabel(f"step of one odb epoch (regime {name}, {reg['samples']} samples, "
                           f"budget {reg['token_budget']})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(results: Dict[str, Any], path: str) -> None:
    """bench.png: planner quality, loader cost, training speed and end-to-end overlap, one panel each; one name per
    arm, every legend below its panel (none over a bar), no tick labels drawn over each other."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planning = results["planning"]
    extra = [k for k in ("loader", "training", "e2e") if k in results]
    panels = 1 + len(extra)
    fig, axes = plt.subplots(1, panels, figsize=(7 + 4.2 * panels, 6.2),
                             gridspec_kw={"width_ratios": [2.4] + [1] * (panels - 1)}, squeeze=False)

    def below(ax: Any, ncol: int) -> None:
        ax.legend(fontsize=7, ncol=ncol, loc="upper center", bbox_to_anchor=(0.5, -0.2), frameon=False)

    def grouped(ax: Any, groups: List[str], series: List[Tuple[str, List[float]]]) -> None:
        width = 0.8 / max(1, len(series))
        for k, (label, ys) in enumerate(series):
            ax.bar([i + (k - (len(series) - 1) / 2) * width for i in range(len(groups))], ys, width, label=label,
                   color=f"C{k}")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(["\n".join(textwrap.wrap(g, 14, break_long_words=False)) for g in groups], fontsize=7)

    ax = axes[0][0]
    names = list(planning["workloads"])
    methods = [m for m in METHOD_ORDER if m != "oracle"
               and any(m in w["methods"] for w in planning["workloads"].values())]
    grouped(ax, names, [(ARM_NAMES.get(m, m), [planning["workloads"][n]["methods"].get(m, {}).get(
        "ratio_to_oracle", 0.0) for n in names]) for m in methods])
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("useful fill / oracle")
    ax.set_title(f"Planner quality (budget {planning['token_budget']})", fontsize=10)
    ax.set_ylim(0, 1.25)
    below(ax, 4)
    for col, key in enumerate(extra, start=1):
        ax = axes[0][col]
        if key == "loader":
            regimes = _loader_regimes(results["loader"])
            arms = list(next(iter(regimes.values()))["median"])
            grouped(ax, list(regimes), [(ARM_NAMES.get(a, a), [reg["median"].get(a, {}).get("samples_per_s", 0.0)
                                                               for reg in regimes.values()]) for a in arms])
            ax.set_ylabel("samples/s")
            ax.set_title(f"Loader ({results['loader']['num_workers']} workers)", fontsize=10)
            below(ax, 2)
        elif key == "training":
            part = results["training"].get("ranks2") or results["training"].get("ranks1") or {"workloads": {}}
            names = list(part["workloads"])
            arms = results["training"].get("arms", [])
            grouped(ax, names, [(TRAIN_ARM_LABELS.get(a, a), [part["workloads"][n]["arms"].get(a, {}).get(
                "tokens_per_s", {}).get("median", 0.0) for n in names]) for a in arms])
            ax.set_ylabel("real tokens/s")
            ax.set_title(f"Training speed ({results['training']['device']}, {part.get('world', 1)} rank(s))",
                         fontsize=10)
            below(ax, 2)
        else:
            e2e = results["e2e"]
            settings = list(e2e["settings"])
            arms = list(e2e["settings"][settings[0]]["median"])
            grouped(ax, settings, [(ARM_NAMES.get(a, a), [e2e["settings"][s_]["median"][a]["overlap"]
                                                          for s_ in settings]) for a in arms])
            ax.axhline(e2e["goals"]["overlap_max"], color="k", lw=0.8, ls="--", label="goal")
            ax.set_ylabel("epoch / max(data, compute)")
            ax.set_title("End to end (overlap)", fontsize=10)
            below(ax, 3)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)

if __name__ == "__main__":
    with open(sys.argv[1] if len(sys.argv) > 1 else "out/bench/results.json") as f:
        print(render(json.load(f), markdown=True))
