"""The benchmark section "rl_update": TRL's GRPO policy update with and without odb, and the plans of an RL
step on many simulated ranks.

1. **Update timing** (``odb.bench.rl_update_train``): the same heavy-tailed rollouts (log-normal completion
   lengths clipped to ``max_completion_length``, prompts of varying length, ``num_generations`` rows per
   prompt) trained by TRL's GRPOTrainer as is (its own ``compute_loss`` on its equal slices, each padded to
   the generation batch's longest prompt and completion) and by the same trainer with
   ``odb.integrations.trl.enable_odb(trainer, token_budget, layout=...)`` (micro-batches under the budget, each
   run without the gap between a row's prompt and its completion: rows right-padded to the micro-batch's
   longest, or packed into one row). One memory cap, the budget: TRL's ``per_device_train_batch_size``
   B is the largest slice whose worst case fits it, B x (longest prompt + max_completion_length) <= budget;
   odb's trainer takes the whole generation batch as its one slice (odb bounds the micro-batches by the
   budget). All train the same rows per optimizer step. Only the policy update is timed (forward and
   backward over the step's slices), on 2 gloo DDP processes, interleaved rounds: median (min-max).
   Padding share = 1 - real tokens / padded tokens processed. Then the same three arms on two variants
   (``VARIANTS``): rollouts as vLLM returns them with TRL's importance-sampling correction on (its default
   ``sequence_mask`` mode and bounds; ``odb.bench.rl_update_rollouts.with_sampling``), and ``loss_type="bnpo"``,
   whose rows now move between the ranks too.
2. **Planning only** (``odb.bench.rl_update_plan``, no model): one generation batch per rank on 8, 32 and
   128 simulated ranks, planned by TRL's equal slices, verl-style Karmarkar-Karp balancing (moves rows between
   ranks, packed), odb's rollout plan (``step_plan="rank"``: rows stay on their rank) and odb's global plan
   (``step_plan="global"``, what the trainer runs on several ranks for every loss_type: rows move), padded and
   packed, every arm under the same budget and per-micro-batch overhead: DDP step efficiency as
   odb.bench.scale defines it, padding share, micro-steps, rows moved and planning milliseconds; and per
   loss type (and the entropy bonus) the plan ``enable_odb`` takes for it on W ranks and its efficiency
   (``loss_type_plans``: rows move for every loss, each row weighted by its own slice's normaliser).

    python benchmarks/rl_update.py [--quick] [--out out/rl_update]   # this section alone
    python -m odb.bench --out out/bench                               # make demo runs it (--skip-rl: not)

Example:
    >>> update_params(quick=True)["budget"] == 2 * (48 + 128)
    True
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, Optional, Sequence

from odb.bench.scale import OVERHEAD
from odb.bench.rl_update_goals import goals, notes
from odb.bench.verdict import paired_spread

# ---- 1. the update timing ---------------------------------------------------------------------------------
# rows per rank per optimizer step, num_generations, prompt (median, sigma, min, max), completion (median, sigma,
# max_completion_length), TRL's per_device_train_batch_size, the tiny Llama
UPDATE = dict(rows=32, generations=4, prompt=(48, 0.5, 8, 128), completion=(96, 1.0, 512), trl_rows=4,
              model=dict(vocab_size=512, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024),
              loss_type="dapo", steps=3, rounds=3, seed=0, threads=1)
UPDATE_QUICK = dict(UPDATE, rows=8, prompt=(24, 0.5, 4, 48), completion=(32, 1.0, 128), trl_rows=2,
                    model=dict(UPDATE["model"], vocab_size=256, hidden_size=64, intermediate_size=256,
                               max_position_embeddings=256), steps=1, rounds=1)
WORLD = 2
# The update's variants: vLLM-style rollouts with TRL's correction at its defaults (mode and bounds; "noise": the
# sampler's per-token log-probability offset), and bnpo (rows move on several processes).
VARIANTS = {"vllm": dict(vllm=dict(mode="sequence_mask", clip_min=None, clip_max=3.0, noise=0.1)),
            "bnpo": dict(loss_type="bnpo", same_slices=True)}
VARIANT_LABELS = {"vllm": "vLLM-style rollouts, TRL's importance-sampling correction on (sequence_mask, clip_max 3)",
                  "bnpo": "loss_type='bnpo', rows moving"}
# Every loss TRL 1.16's GRPOTrainer and RLOOTrainer have, and the entropy bonus (its own per-token normaliser).
LOSS_PLANS = ("grpo", "sapo", "luspo", "dr_grpo", "bnpo", "dapo", "cispo", "vespo", "rloo", "entropy bonus")

# ---- 2. planning only -------------------------------------------------------------------------------------
PLAN = dict(rows=64, generations=8, prompt=(256, 0.7, 16, 1024), completion=(700, 1.0, 4096), trl_rows=4)
PLAN_WORLDS, PLAN_STEPS = (8, 32, 128), {8: 4, 32: 3, 128: 2}
PLAN_QUICK_WORLDS, PLAN_QUICK_STEPS = (8,), {8: 1}

ARM_LABELS = {"trl": "TRL as is", "odb": "odb padded (enable_odb)", "odb_packed": "odb packed (layout='packed')"}


def budget_of(p: Dict[str, Any]) -> int:
    """The token budget whose worst case TRL's slice of ``trl_rows`` fills: rows x (max prompt + max completion)."""
    return int(p["trl_rows"] * (p["prompt"][3] + p["completion"][2]))


def update_params(quick: bool = False) -> Dict[str, Any]:
    p = dict(UPDATE_QUICK if quick else UPDATE)
    p["budget"] = budget_of(p)
    return p


def run_update(p: Dict[str, Any], world: int = WORLD, timeout_s: float = 600.0) -> Dict[str, Any]:
    """Part 1 on ``world`` processes, or on 1 process (with the reason) when ``world`` processes fail."""
    from odb.bench.rl_update_train import launch, summarize

    t0 = time.perf_counter()
    print(f"[bench] rl_update: policy update on {world} gloo process(es), {p['rounds']} round(s) of 3 arms x "
          f"{p['steps']} step(s)", file=sys.stderr, flush=True)
    try:
        out = summarize(launch(p, world, timeout_s))
        out["world"] = world
    except Exception as err:  # noqa: BLE001 - 1 process, labelled, rather than no figure
        if world == 1:
            raise
        print(f"[bench] rl_update: {world} processes failed ({err!r:.300}); measuring on 1 process", file=sys.stderr)
        out = summarize(launch(p, 1, timeout_s))
        out.update(world=1, fallback=f"{world} gloo processes failed ({err!r:.500}): measured on 1 process")
    print(f"[bench] rl_update: policy update done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    trl = out["arms"]["trl"]
    out["ratios"] = {arm: a["update_s"]["median"] / trl["update_s"]["median"] for arm, a in out["arms"].items()}
    out["ratio_spreads"] = {arm: paired_spread(zip(a["rounds_s"], trl["rounds_s"])) for arm, a in out["arms"].items()}
    out["ratio"], out["ratio_spread"] = out["ratios"]["odb"], out["ratio_spreads"]["odb"]  # the default layout
    out["settings"] = {k: v for k, v in p.items()}
    return out


def run_rl_update(quick: bool = False, progress: Callable[..., Any] = lambda it, **kw: it, world: int = WORLD,
                  planning: bool = True, variants: bool = True) -> Dict[str, Any]:
    """The section: the update timing (and its ``VARIANTS``), then the planning comparison; plain JSON-able
    results."""
    from odb.bench.rl_update_plan import MOVES_ROWS, PLAN_ARM_LABELS, PLANNED_ONLY, run_planning

    t_all = time.perf_counter()
    p = update_params(quick)
    result: Dict[str, Any] = {"quick": quick, "arm_labels": ARM_LABELS, "wall_s": {}}
    t0 = time.perf_counter()
    result["update"] = run_update(p, world)
    result["wall_s"]["update"] = time.perf_counter() - t0
    if variants:
        t0 = time.perf_counter()
        result["variant_labels"] = VARIANT_LABELS
        result["updates"] = {name: run_update(dict(p, **v), world) for name, v in VARIANTS.items()}
        result["wall_s"]["variants"] = time.perf_counter() - t0
    if planning:
        t0 = time.perf_counter()
        q = dict(PLAN, budget=budget_of(PLAN), overhead=OVERHEAD)
        worlds, steps = (PLAN_QUICK_WORLDS, PLAN_QUICK_STEPS) if quick else (PLAN_WORLDS, PLAN_STEPS)
        result["planning"] = {"settings": {**q, "worlds": list(worlds), "steps": {str(w): steps[w] for w in worlds}},
                              "arm_labels": PLAN_ARM_LABELS, "moves_rows": MOVES_ROWS,
                              "planned_only": list(PLANNED_ONLY),
                              "worlds": run_planning(worlds, steps, q["rows"], q["generations"], q["prompt"],
                                                     q["completion"], q["budget"], OVERHEAD, q["trl_rows"],
                                                     progress=progress)}
        result["planning"]["loss_types"] = loss_type_plans(result["planning"]["worlds"])
        result["wall_s"]["planning"] = time.perf_counter() - t0
    result["goals"] = goals(result)
    result["notes"] = notes(result)
    result["wall_s"]["total"] = time.perf_counter() - t_all
    return result


def loss_type_plans(worlds: Dict[str, Any]) -> Dict[str, Any]:
    """Per simulated world size, the plan ``enable_odb`` takes (``step_plan="auto"``) for every loss of
    ``LOSS_PLANS`` and its DDP step efficiency, padded and packed, from the planning arms it runs.

    Example:
        >>> cell = {"arms": {a: {"ddp": {"median": 0.9}} for a in ("odb_global", "odb_global_packed")}}
        >>> loss_type_plans({"8": cell})["8"]["bnpo"]["step_plan"]
        'global'
    """
    from odb.integrations.trl.rl import resolve_step_plan

    out: Dict[str, Any] = {}
    for w, cell in worlds.items():
        row = {}
        for loss in LOSS_PLANS:
            name = "RLOOTrainer" if loss == "rloo" else "GRPOTrainer"
            plan = resolve_step_plan("auto", name, int(w))  # the same for every loss: its rows carry their weights
            arms = ("odb_global", "odb_global_packed") if plan == "global" else ("odb_rollout", "odb_rollout_packed")
            row[loss] = {"step_plan": plan, "padded": cell["arms"][arms[0]]["ddp"],
                         "packed": cell["arms"][arms[1]]["ddp"]}
        out[w] = row
    return out


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes (seconds; figures not meaningful)")
    ap.add_argument("--world", type=int, default=WORLD, help=f"processes of the update timing (default {WORLD})")
    ap.add_argument("--out", default="out/rl_update", help="folder of results.json and summary.md")
    args = ap.parse_args(argv)
    from odb.bench.report import goals_table, rl_update_table

    result = run_rl_update(quick=args.quick, world=args.world)
    os.makedirs(args.out, exist_ok=True)
    whole = {"meta": {"command": "benchmarks/rl_update.py " + " ".join(argv or sys.argv[1:]), "quick": args.quick},
             "rl_update": result}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(whole, f, indent=1)
    text = goals_table(whole) + "\n\n" + rl_update_table(result)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(goals_table(whole, markdown=True) + "\n\n" + rl_update_table(result, markdown=True) + "\n")
    print(text)
    return result
