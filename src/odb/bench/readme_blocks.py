"""README's generated blocks, from a results file of ``python -m odb.bench``: the plot of held-out loss against
time and its caption (``plot_body``), one table with a row per setting (``table_body``: ``odb.bench.headline``),
and the measured times of ``make demo`` and ``make bench`` (``times_body``). scripts/update_readme.py
(``make publish``) writes them between README's markers; docs/benchmarks.md's blocks: ``odb.bench.published``.

Example:
    >>> table_body({"meta": {}, "wall_s": {"total": 60.0}})[-1]
    '(this results file holds none of the settings of the table)'
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from odb.bench.headline import CONV_ARMS, PLOT_ARMS, headline_table
from odb.bench.published import _where
from odb.bench.report import goals


def _target_times(conv: Dict[str, Any], acc: str) -> str:
    """'odb packed 7.7 s, TRL packing 8.3 s, ...': seconds to the target of the plot's arms at accumulation acc."""
    arms = conv["accumulations"][acc]["arms"]
    times = [(a, (arms[a].get("time_read_s") or {}).get("median")) for a in PLOT_ARMS if a in arms]
    reached = sorted((t, a) for a, t in times if t is not None)
    out = ", ".join(f"{CONV_ARMS.get(a, a)} {t:.1f} s" for t, a in reached)
    missed = [CONV_ARMS.get(a, a) for a, t in times if t is None]
    return out + (f" ({', '.join(missed)}: not reached)" if missed else "")


def plot_body(results: Dict[str, Any], image: str) -> List[str]:
    """README's picture: held-out loss against training time (``image``, drawn by ``plot_loss_vs_time``) and a
    caption with each arm's seconds to the target, median over rounds."""
    conv = results.get("convergence")
    if not conv:
        return ["(this results file has no convergence section: no plot)"]
    accs = sorted(conv["accumulations"], key=int)
    times = "; ".join(f"A = {acc}: {_target_times(conv, acc)}" for acc in accs)
    return [f"![Held-out loss against training seconds, 2 DDP ranks on CPU: odb packed and padded beside fixed "
            f"batches, group_by_length and TRL packing]({image})", "",
            f"*Time to a model*: held-out loss against training seconds on 2 DDP ranks ({conv['rounds']} "
            f"interleaved rounds; drawn: the round of fixed's median time), every arm at the same samples per optimizer "
            f"step (G = B x A x 2), learning rate and memory cap ({conv['cap']:,} padded tokens per micro-batch). "
            f"Seconds to fixed's final loss, median ({_read_note(conv)}): {times}. From "
            f"`make bench`{_where(results.get('meta', {}))}; every arm and its spread: "
            f"[docs/benchmarks.md](docs/benchmarks.md)."]


def _read_note(conv: Dict[str, Any]) -> str:
    """How the caption's times are read: arms whose every step held fixed's samples make fixed's updates."""
    same = sorted({CONV_ARMS.get(a, a) for part in conv["accumulations"].values() for a, m in part["arms"].items()
                   if a != "fixed" and a in PLOT_ARMS and m.get("same_samples_as_fixed")})
    if not same:
        return "each arm's own curve"
    return (f"{' and '.join(same)} make fixed's updates, so theirs is read at the optimizer step where fixed reached "
            f"it; the others' on their own curves")


def table_body(results: Dict[str, Any]) -> List[str]:
    """README's benchmark table: one row per setting, odb's best arm against the best other arm, and where the
    run comes from."""
    meta = results.get("meta", {})
    machine = meta.get("machine", {})
    wall = results.get("wall_s", {}).get("total", 0.0)
    measured = [g for g in goals(results) if g.met is not None]
    line = (f"From `make bench` ({wall / 60:.1f} min{_where(meta)}, {meta.get('date', 'date unknown')}) on "
            f"{machine.get('logical_cpus', '?')} CPUs, no GPU; odb's best arm against the best other arm at the same "
            f"settings, median and spread (min-max over rounds; scale: p10-p90 over steps). Seconds: lower is "
            f"better; efficiency and tokens/s: higher.")
    if measured:
        line += (f" Goals met: {sum(bool(g.met) for g in measured)} of {len(measured)}. Every table, the goals and "
                 f"their verdicts, the GPU run: [docs/benchmarks.md](docs/benchmarks.md).")
    table = headline_table(results)
    return [line, "", *table] if table else [line, "", "(this results file holds none of the settings of the table)"]


def _load(load: Optional[List[float]]) -> str:
    return "?" if not load else f"{load[0]:.1f}"


def times_body(bench: Dict[str, Any], demo: Optional[Dict[str, Any]]) -> List[str]:
    """How long ``make demo`` and ``make bench`` took: each run's own clock, commit and load averages."""
    def run(results: Dict[str, Any], name: str) -> str:
        meta = results.get("meta", {})
        wall = results.get("wall_s", {})
        sections = ", ".join(f"{k} {v / 60:.1f}" for k, v in wall.items() if k != "total")
        return (f"`{name}` {wall.get('total', 0.0) / 60:.1f} min{_where(meta)}, {meta.get('date', 'date unknown')} "
                f"(sections, min: {sections}; 1-minute load average {_load(meta.get('load_average_start'))} at the "
                f"start, {_load(meta.get('load_average_end'))} at the end)")

    machine = bench.get("meta", {}).get("machine", {})
    out = (f"Measured on {machine.get('logical_cpus', '?')} CPUs ({machine.get('cpu', '?')}, no GPU), `.venv` built "
           f"beforehand (about 2 min), each run's own clock: ")
    out += (run(demo, "make demo") + "; " if demo else "`make demo`: no published run (docs/results/demo.json); ")
    out += (run(bench, "make bench") + ", the run published above. A load average above the cores means other "
            "work shared them and stretched the times.")
    return [out]
