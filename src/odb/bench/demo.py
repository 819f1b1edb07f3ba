"""``make demo``: the benchmark's headline at reduced but honest sizes, in minutes on 2 cores.

``python -m odb.bench --demo --out out/demo`` runs two sections of the full benchmark (``make bench``) with the
same code, model, data, cap and learning rate, and says what it left out:

- convergence (time to a model at the user's settings, 2 gloo DDP ranks, A = 1 and A = 8): the arms a user
  picks between (fixed, group_by_length, TRL packing, odb padded, odb packed) and odb's own length-grouped steps,
  packed, one round (the full run: every arm, 3 interleaved rounds and their spread);
- scale (step efficiency from 2 to 1,024 simulated ranks): ShareGPT lengths at 4 and 16 samples per rank, odb's
  global step plan against fixed, group_by_length and BatchRebalance (the full run: gettext lengths and 1 sample
  per rank too, and odb's per-rank plan).

Each section's own parts (``DEMO_CONVERGENCE``, ``DEMO_SCALE``) are data: another arm added to the convergence
section joins the demo by its name here.

Example:
    >>> [line.split(":")[0] for line in plan_lines()]
    ['- convergence', '- scale']
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

# The convergence section's full sizes but one round, and the arms a user picks between.
DEMO_CONVERGENCE: Dict[str, Any] = {
    "size": {"workload": "heavy-tailed", "samples": 384, "epochs": 2, "evals": 6, "rounds": 1,
             "accumulations": [1, 8], "extra_epochs": 1},
    "arms": ("fixed", "group_by_length", "trl_packing", "odb_padded", "odb_packed", "odb_length_grouped_packed"),
}
DEMO_SCALE: Dict[str, Any] = {
    "workloads": ("sharegpt",), "worlds": (2, 8, 32, 128, 1024), "shares": (4, 16),
    "arms": ("fixed", "group_by_length", "batch_rebalance", "odb_global", "odb_global_packed"),
    "skip": {("sharegpt", 1024, 16): {"batch_rebalance": "its own plan of one step of 16,384 samples takes ~25 s "
                                                         "(make bench runs it)"}},
    "plan_repeats": 3,
}
LEFT_OUT = {
    "convergence": "make bench: 12 arms (also BatchRebalance, odb budget-filled, odb's per-rank plan, odb on "
                   "group_by_length's steps padded and packed, odb length_grouped padded), 3 interleaved rounds "
                   "with their min-max",
    "scale": "make bench: gettext lengths too, 1 sample per rank, odb's per-rank arms, BatchRebalance at 1,024 x 16",
    "sections": "make bench also runs planner quality, ranks, loader cost, training speed, packed layout, "
                "token_budget='auto', vision-language training, the GRPO policy update and end to end",
}


def plan_lines() -> List[str]:
    """What the demo runs and what it leaves to ``make bench``, one line per section."""
    c, s = DEMO_CONVERGENCE, DEMO_SCALE
    size = c["size"]
    return [f"- convergence: 2 DDP ranks, {len(c['arms'])} arms ({', '.join(c['arms'])}), A = "
            f"{' and '.join(str(a) for a in size['accumulations'])}, {size['samples']} samples x {size['epochs']} "
            f"epochs, {size['rounds']} round, so no spread ({LEFT_OUT['convergence']})",
            f"- scale: {', '.join(s['workloads'])} lengths, {s['worlds'][0]} to {s['worlds'][-1]:,} simulated ranks "
            f"x {' and '.join(str(x) for x in s['shares'])} samples per rank, {len(s['arms'])} arms "
            f"({LEFT_OUT['scale']})"]


def run_demo(results: Dict[str, Any], out_dir: str, progress: Callable[..., Any],
             section: Callable[[str], None], timer: Callable[[], float], quick: bool = False) -> None:
    """Run the demo's sections into ``results`` (their wall times under ``results["wall_s"]``). ``quick``: the
    demo's arms at the smoke test's tiny sizes (its figures mean nothing)."""
    from odb.bench.convergence import SIZES
    from odb.bench.convergence_run import run_convergence_section
    from odb.bench.scale import QUICK_SHARES, QUICK_WORLDS, run_scale

    results["meta"]["demo"] = {"runs": plan_lines(), "left_out": LEFT_OUT}
    section("convergence (demo): " + plan_lines()[0][len("- convergence: "):])
    t0 = timer()
    results["convergence"] = run_convergence_section(
        out_dir=out_dir, size=SIZES["quick"] if quick else DEMO_CONVERGENCE["size"], arms=DEMO_CONVERGENCE["arms"])
    results["wall_s"]["convergence"] = timer() - t0
    section("scale (demo): " + plan_lines()[1][len("- scale: "):])
    t0 = timer()
    s = DEMO_SCALE
    results["scale"] = run_scale(progress=progress, quick=quick, worlds=QUICK_WORLDS if quick else s["worlds"],
                                 shares=QUICK_SHARES if quick else s["shares"], workloads=s["workloads"],
                                 arms=s["arms"], skip=s["skip"], plan_repeats=s["plan_repeats"])
    results["wall_s"]["scale"] = timer() - t0
