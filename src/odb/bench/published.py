"""docs/benchmarks.md's generated Markdown: what scripts/update_readme.py (``make publish``) writes between its
markers, from a results file of ``python -m odb.bench`` (``make bench``) and, for the GPU blocks, of
``scripts/gpu_check.sh``. README's blocks: ``odb.bench.readme_blocks``.

- ``summary_body``: the convergence, training-speed and vision-language tables, the headline lines and the goals;
- ``tables_body``: every table of the run (``odb.bench.report.render``);
- ``gpu_summary_body`` and ``gpu_tables_body``: the GPU run.

Every function takes the parsed results and returns lines; none writes a file.

Example:
    >>> _num(None), _num(0.5)
    ('-', '0.500')
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from odb.bench.report import goals, render, training_table

# The training arms, in the README table's order: (key in results.json, column label).
TRAIN_ARMS = (("fixed", "fixed batch"), ("group_by_length", "group_by_length"), ("batch_rebalance", "BatchRebalance"),
              ("trl_packing", "TRL packing"), ("odb_padded", "**odb**"), ("odb_packed", "**odb packed**"))


def _num(x: Optional[float], spec: str = "{:.3f}") -> str:
    return "-" if x is None else spec.format(x)


def _met(ok: bool) -> str:
    return "met" if ok else "**not met**"


def speed_table(part: Dict[str, Any]) -> List[str]:
    """Real tokens/s (median) and steps of every arm per workload, and odb's ratios over the baselines."""
    present = [(k, label) for k, label in TRAIN_ARMS if any(k in w["arms"] for w in part["workloads"].values())]
    header = ["workload (samples, mean / max tokens)"] + [label for _, label in present] + [
        "odb / group_by_length", "odb packed / TRL packing", "odb / fixed"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for name, w in part["workloads"].items():
        arms, over = w["arms"], w["odb_over"]
        cells = [f"{name} ({w['samples']:,}, {w['mean_length']:.0f} / {w['max_length']})"]
        for key, _ in present:
            a = arms.get(key)
            cells.append("-" if a is None else f"{a['tokens_per_s']['median']:,.0f} ({a['steps']} steps)")
        cells += [_num(over.get("odb_padded", {}).get("group_by_length"), "{:.2f}x"),
                  _num(over.get("odb_packed", {}).get("trl_packing"), "{:.2f}x"),
                  _num(over.get("odb_padded", {}).get("fixed"), "{:.2f}x")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _slower(part: Dict[str, Any]) -> str:
    """Where neither odb arm beats a baseline, worst first (one sentence), or that an odb arm is fastest."""
    worse = sorted(((max(w["odb_over"].get(o, {}).get(base, 0.0) for o in ("odb_padded", "odb_packed")), name, base)
                    for name, w in part["workloads"].items() for base in w["arms"] if not base.startswith("odb")),
                   key=lambda t: t[0])
    worse = [t for t in worse if t[0] < 1.0]
    if worse:
        return "Where neither odb arm is faster: " + "; ".join(
            f"{name}, the faster odb arm at {r:.2f}x {base}" for r, name, base in worse) + " (docs/benchmarks.md says why)."
    return "On every workload above, an odb arm is the fastest."


def training_section(tr: Dict[str, Any]) -> List[str]:
    """The headline: real tokens/s of every arm on 2 DDP ranks, and odb's ratio over group_by_length and packing."""
    r2 = tr["ranks2"]
    lines = speed_table(r2)
    fixed_b = ", ".join(f"{w['fixed_batch_size']}" for w in r2["workloads"].values())
    out = [f"**Training speed** (each micro-batch its own optimizer step: tokens/s only, not the same updates): real (supervised) tokens per second of a small Llama trained on real text, "
           f"{r2['world']} DDP ranks (gloo, {tr['device']}, {r2['threads']} thread each), every arm under the same "
           f"memory cap of {tr['cap']:,} padded tokens per micro-batch; median of {tr['rounds']} interleaved rounds "
           f"(spread in docs/benchmarks.md). Fixed-size arms use the largest batch whose longest sample fits the cap "
           f"(B = {fixed_b}); every arm at its defaults, odb's with `token_budget=cap, shift_labels=True` "
           f"(settings per arm in docs/benchmarks.md). Steps are per rank.", "", *lines]
    out += ["", _slower(r2)]
    r1 = tr.get("ranks1")
    if r1:
        for name, w in r1["workloads"].items():
            o = w["odb_over"].get("odb_padded", {})
            out.append(f"On 1 process ({name}, {w['samples']:,} samples): odb " + ", ".join(
                f"{v:.2f}x {k}" for k, v in o.items() if k != "odb_packed") + ".")
    return out


def planning_line(planning: Dict[str, Any]) -> str:
    ws = planning["workloads"]
    gaps = {n: w["methods"]["odb-default"].get("token_efficiency_minus_length_grouped") for n, w in ws.items()}
    gaps = {n: g for n, g in gaps.items() if g is not None}
    worst = min(gaps, key=gaps.get) if gaps else None
    fill = {n: w["methods"]["odb-default"]["useful_fill"] for n, w in ws.items()}
    base = {n: max(w["methods"][k]["useful_fill"] for k in ("fixed", "length_grouped") if k in w["methods"])
            for n, w in ws.items()}
    out = (f"**Planning alone** ({len(ws)} workloads, {planning['token_budget']:,}-token budget, full epochs): odb's "
           f"tokens per step are {min(fill.values()):.2f}-{max(fill.values()):.2f} of the budget against "
           f"{min(base.values()):.2f}-{max(base.values()):.2f} for fixed-size batches")
    if worst is not None:
        out += (f"; its token efficiency (real / padded) minus group_by_length's is {gaps[worst]:+.3f} on its worst "
                f"workload ({worst})")
    return out + "."


def headline_section(results: Dict[str, Any]) -> List[str]:
    out: List[str] = []
    if results.get("planning"):
        out.append("- " + planning_line(results["planning"]))
    e2e = results.get("e2e")
    if e2e:
        for name, st in e2e["settings"].items():
            o = st["median"]["odb"]
            out.append(f"- End to end, {name}: odb's epoch is {o['overlap']:.2f}x max(data time, compute time); "
                       f"x{st['odb_vs_plain_fit']:.2f} the epoch of fixed batching"
                       + (f", x{st['odb_vs_length_grouped']:.2f} that of group_by_length"
                          if st.get("odb_vs_length_grouped") is not None else "") + ".")
    loader = results.get("loader")
    if loader:
        for name, reg in (loader.get("regimes") or {}).items():
            r = reg["ratios"]
            out.append(f"- Loader cost ({name}), against a plain DataLoader replaying odb's own batches: "
                       f"{r['samples_per_s_ratio']:.2f}x samples/s, {r['cpu_s_ratio']:.2f}x CPU seconds.")
    goals = _all_goals(results)
    if goals:
        missed = [g for g in goals if g.met is False]
        close = [g for g in goals if g.straddles]
        out.append(f"- Goals of the benchmark: {len(goals) - len(missed)} of {len(goals)} met by the median; each, "
                   f"with its figure, in docs/benchmarks.md" + (f" (not met: {len(missed)}, listed there)" if missed
                                                              else "")
                   + (f"; in {len(close)} of them the rounds' min-max straddles the target, so another run could "
                      f"turn the verdict ({'; '.join(g.goal for g in close)})." if close else "."))
    return out


def _all_goals(results: Dict[str, Any]) -> List[Any]:
    return [g for g in goals(results) if g.met is not None]


def _where(meta: Dict[str, Any]) -> str:
    """", odb at commit X" from a results file's git record ("" without one)."""
    git = meta.get("git") or {}
    commit = git.get("commit")
    return "" if not commit else f", odb at commit {commit[:10]}{' (with local changes)' if git.get('dirty') else ''}"


def _loads(load: Any) -> str:
    """'a at the start, b at the end' of 1-minute load averages ([start, end] of [1, 5, 15]-minute triples)."""
    try:
        return f"{load[0][0]:.1f} at the start, {load[1][0]:.1f} at the end (2 cores)"
    except (TypeError, IndexError):
        return "?"


def _run_line(results: Dict[str, Any]) -> str:
    meta = results.get("meta", {})
    machine = meta.get("machine", {})
    where = _where(meta)
    wall = results.get("wall_s", {}).get("total")
    line = (f"From `make bench` (`python -m odb.bench --out out/bench`, {wall / 60:.1f} min{where}) on "
            f"{machine.get('logical_cpus', '?')} CPUs ({machine.get('cpu', '?')}), torch {machine.get('torch', '?')}, "
            f"transformers {machine.get('transformers', '?')}")
    conv = meta.get("convergence_run")
    if conv:  # the convergence section measured on its own, its results put beside the other sections' run
        cwhere = _where(conv)
        line = (f"Convergence section from `{conv['command']}` ({conv['wall_s'] / 60:.1f} min{cwhere}, "
                f"{conv.get('date', 'date unknown')}, load average {_loads(conv.get('load'))}); the other sections "
                + line[0].lower() + line[1:])
    return line


def _load_text(meta: Dict[str, Any]) -> str:
    start, end = meta.get("load_average_start"), meta.get("load_average_end")
    if not start or not end:
        return ""
    return (f" Load average (1 min) {start[0]:.1f} at the start and {end[0]:.1f} at the end "
            f"(15 min: {end[2]:.1f}); more than the cores means other work shared them.")


def _spread(t: Optional[Dict[str, float]], spec: str = "{:.1f}") -> str:
    if not t:
        return "-"
    return f"{spec.format(t['median'])} ({spec.format(t['min'])}-{spec.format(t['max'])})"


CONV_LABELS = {"fixed": "fixed batch", "group_by_length": "group_by_length", "batch_rebalance": "BatchRebalance",
               "trl_packing": "TRL packing", "odb_padded": "**odb padded**", "odb_packed": "**odb packed**",
               "odb_budget_filled": "odb budget-filled (not the same updates)",
               "odb_padded_rank": "odb padded, per-rank plan (`step_plan=\"rank\"`)"}


def convergence_section(conv: Dict[str, Any]) -> List[str]:
    """The headline: time to a held-out loss, every arm at the user's samples per optimizer step, A = 8 then 1."""
    m = conv.get("model") or {}
    out = [f"**Time to a model at your settings**: a Llama of {m.get('num_hidden_layers', '?')} layers x "
           f"{m.get('hidden_size', '?')} hidden trained on real text ({conv['workload']} lengths, {conv['samples']} "
           f"samples, mean {conv['mean_length']:.0f} / max {conv['max_length']} tokens), {conv['world']} DDP ranks "
           f"(gloo, CPU), a memory cap of {conv['cap']:,} padded tokens per micro-batch: micro-batch B = "
           f"{conv['fixed_batch_size']} (the largest whose longest sample fits), accumulation A, so an optimizer step "
           f"holds G = B x A x {conv['world']} samples in every arm (TRL packing: as near as its rows allow), at the "
           f"same learning rate ({conv['base_lr']:g}, AdamW, constant) from the same weights. Time to the target = "
           f"seconds until the held-out loss reaches the fixed arm's final loss ({conv['epochs']} epochs); median "
           f"(min-max) of {conv['rounds']} interleaved rounds; loss at equal time = at the shortest arm's training "
           "time. An arm whose every step holds fixed's samples (checked in the run) makes fixed's updates, so its "
           "curve differs from fixed's only by rounding that training amplifies: its ratio to fixed's time is read at "
           "the step where fixed reached the target. odb: `ODBDataLoader(token_budget=cap, global_batch_size=G)`; "
           "budget-filled odb (no `global_batch_size`, today's default) puts more samples in each update and is not "
           "the same run."]
    for acc in sorted(conv["accumulations"], key=lambda a: -int(a)):
        part = conv["accumulations"][acc]
        header = ["arm", "samples / step", "optimizer steps", "micro-steps / step", "real tokens/s",
                  "s to target", "time / fixed's", f"held-out loss at {part['equal_time_s']['median']:.1f} s"]
        lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
        for arm, a in part["arms"].items():
            ttt = _spread(a["time_to_target_s"]) if a["time_to_target_s"] else (
                f"not reached in {a['reached']} of {len(part.get('rounds', [])) or conv['rounds']} rounds"
                if a["reached"] else "not reached")
            lines.append("| " + " | ".join([
                CONV_LABELS.get(arm, arm), f"{a['samples_per_step']:.1f}", str(a["steps"]),
                f"{a['micro_steps_per_step']:.2f}", _spread(a["tokens_per_s"], "{:,.0f}"), ttt,
                _num(a.get("time_vs_fixed"), "{:.2f}x"), _spread(a["loss_at_equal_time"], "{:.3f}")]) + " |")
        out += ["", f"A = {acc} (G = {part['global_batch_size']} samples per step), target loss "
                f"{part['target_loss']['median']:.3f}:", "", *lines]
    goals = conv.get("goals") or []
    if goals:
        from_goal = []
        for g in goals:
            what = f"A = {g.get('accumulation', 8)}, " + g["goal"].split("): ", 1)[-1]
            fig = (f"{g['measured']:.2f} (target <= {g['target']})" if g.get("gap") is None and g["measured"] is not None
                   else f"largest gap {g['gap']['max_gap']:.3f}" if g.get("gap") else "-")
            spread = g.get("spread")
            fig += "" if spread is None else f", rounds {spread[0]:.2f}-{spread[1]:.2f}"
            from_goal.append(f"{what}: {fig}, {_met(g['met'])}" + (" (the spread straddles the target)"
                                                                  if g.get("straddles") else ""))
        out += ["", "Goals: " + "; ".join(from_goal) + ". Each missed goal's measured breakdown (padding "
                "share, micro-steps per step, loader waits): docs/benchmarks.md."]
    return out


VLM_LABELS = {"fixed": "fixed batch", "group_by_length": "group_by_length", "odb_padded": "**odb padded**",
              "odb_packed": "**odb packed**"}


def _vlm_run_line(results: Dict[str, Any]) -> str:
    """Where the VLM figures come from: the merged --only-vlm run, else the run of the whole file."""
    run = results.get("meta", {}).get("vlm_run")
    if run:
        return (f", from `{run['command']}` ({run['wall_s'] / 60:.1f} min{_where(run)}, {run.get('date', 'date unknown')}; "
                f"load average {_loads(run.get('load'))})")
    return ", from the run above"


def vlm_section(results: Dict[str, Any]) -> List[str]:
    """The VLM block: real tokens/s and vision patches/s of every arm per model, at one memory cap."""
    vlm = results["vlm_training"]
    header = ["model", "arm", "real tokens/s", "vision patches/s", "micro-steps (optimizer steps)", "padding share",
              "x group_by_length"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for name, w in vlm["workloads"].items():
        gbl = w["arms"]["group_by_length"]["tokens_per_s"]["median"]
        for i, (key, label) in enumerate(VLM_LABELS.items()):
            a = w["arms"][key]
            first = (f"{name} ({w['samples']} samples, mean / max {w['mean_length']:.0f} / {w['max_length']} tokens, "
                     f"B = {w['batch_size']}, G = {w['global_batch_size']})") if i == 0 else ""
            lines.append("| " + " | ".join([
                first, label, f"{a['tokens_per_s']['median']:,.0f}", f"{a['patches_per_s']['median']:,.0f}",
                f"{a['micro_steps']} ({a['steps']})", f"{a['padding_share']:.2f}",
                f"{a['tokens_per_s']['median'] / gbl:.2f}x"]) + " |")
    worst = vlm["worst"]
    return [f"**Vision-language training**{_vlm_run_line(results)}: tiny Qwen2-VL and LLaVA built from configs with "
            f"their real processors, chat samples of which about half carry 1-2 images of {vlm['sides'][0]}-"
            f"{vlm['sides'][1]} px, 1 process ({vlm['threads']} CPU thread); every arm trains the same G = B x A "
            "samples per optimizer step under one memory cap (padded tokens per micro-batch, B the largest whose "
            "longest sample fits, and B x the most patches of one sample); median of "
            f"{vlm['rounds']} interleaved rounds (spread, caps and settings in docs/benchmarks.md). TRL's "
            "SFTTrainer trains VLMs as the padded fixed or group_by_length arm (TRL 1.16 refuses packing and "
            "padding-free rows for vision data).", "", *lines, "",
            "Worst case, each odb arm's lowest ratio over a baseline: " + "; ".join(
                f"{o.replace('_', ' ')} {w['ratio']:.2f}x {w['baseline']} ({w['workload']})" for o, w in worst.items())
            + ". group_by_length sorts the samples into steps by length (a step of long samples, then one of short "
              "ones); odb with `global_batch_size` keeps each step's random samples (fixed's steps) and groups only "
              "within a step, so padded odb pads more than group_by_length; packed rows pad nothing."]


def summary_body(results: Dict[str, Any]) -> List[str]:
    """docs/benchmarks.md's summary of the published run: the convergence, training-speed and vision-language
    tables, the headline lines and the goals (README's benchmark section before it became one table)."""
    intro = (_run_line(results) + "; published with `make publish` into docs/results/bench.json. Definitions and "
             "method: above; every table: below.")
    body = [intro, ""]
    if results.get("convergence"):
        body += [*convergence_section(results["convergence"]), ""]
    if results.get("training", {}).get("ranks2"):
        body += [*training_section(results["training"]), ""]
    if results.get("vlm_training"):
        body += [*vlm_section(results), ""]
    body += headline_section(results)
    return body


def tables_body(results: Dict[str, Any]) -> List[str]:
    """docs/benchmarks.md's measured tables: where the run comes from, then every table and goal (``render``)."""
    meta = results.get("meta", {})
    machine = meta.get("machine", {})
    wall = results.get("wall_s", {})
    lines = ["",
             _run_line(results) + f"; {meta.get('date', 'date unknown')}."
             + (f" Vision-language section{_vlm_run_line(results)}." if meta.get("vlm_run") else ""),
             f"Machine: {machine.get('platform', '?')}, Python {machine.get('python', '?')}, "
             f"torch used {machine.get('torch_threads', '?')} threads{', GPU ' + machine['gpu'] if machine.get('gpu') else ', no GPU'}. "
             "Wall time per section: " + ", ".join(f"{k} {v:.1f} s" for k, v in wall.items()) + "." + _load_text(meta),
             "",
             *("#" + line if line.startswith("##") else line for line in render(results, markdown=True).split("\n")),
             ""]
    return lines


def _gpu_run_line(results: Dict[str, Any]) -> str:
    meta = results.get("meta", {})
    machine = meta.get("machine", {})
    where = _where(meta)
    wall = results.get("wall_s", {}).get("total", 0.0)
    return (f"From `{meta.get('command', 'python -m odb.bench --device cuda')}` ({wall / 60:.1f} min{where}) on one "
            f"{machine.get('gpu', 'GPU')} ({machine.get('logical_cpus', '?')} CPUs), torch {machine.get('torch', '?')}, "
            f"transformers {machine.get('transformers', '?')}, {meta.get('date', 'date unknown')}")


def gpu_summary_body(results: Dict[str, Any]) -> List[str]:
    """The GPU run's 1-process training table (docs/benchmarks.md, "Measured on a GPU")."""
    tr = results["training"]
    part, m = tr["ranks1"], tr["model"]
    fixed_b = ", ".join(f"{w['fixed_batch_size']}" for w in part["workloads"].values())
    body = [_gpu_run_line(results) + "; results file docs/results/bench_gpu.json.", "",
            f"**On a GPU**: 1 process, bf16 autocast, a Llama of {m['num_hidden_layers']} layers x {m['hidden_size']} "
            f"hidden (about 85M parameters; too small to saturate this GPU, so the number of steps, not the padding, "
            f"dominates its time) on full-length samples, every arm under a cap of {tr['cap']:,} padded "
            f"tokens per micro-batch (fixed B = {fixed_b}); real tokens/s, median of {tr['rounds']} interleaved rounds "
            f"(the first round of each arm pays its new shapes' kernel setup; spread and peak memory in "
            f"docs/benchmarks.md).", "", *speed_table(part), "", _slower(part)]
    return body


def gpu_tables_body(results: Dict[str, Any]) -> List[str]:
    """docs/benchmarks.md's GPU tables: every arm with spread, steps, token efficiency and peak memory."""
    table = training_table(results["training"], markdown=True)
    return ["", _gpu_run_line(results) + ".", "", *table.split("\n"), ""]

