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
   ``sequence_mask`` mode and bounds; ``odb.bench.rl_update_train.with_sampling``), and ``loss_type="bnpo"``,
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
from typing import Any, Callable, Dict, List, Optional, Sequence

from odb.bench.scale import OVERHEAD
from odb.bench.verdict import paired_spread, spread_text, straddles

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
PADDING_MAX, TIME_RATIO_MAX, GRAD_GAP_MAX = 0.15, 0.6, 1e-5
PACKED_PADDING_MAX = 0.02  # the goal for packed rows
STEP_EFFICIENCY_MIN = 0.95  # rows moving at 8-128 ranks, every loss type (bnpo and the entropy bonus included)
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
    from odb.integrations.trl_rl import resolve_step_plan

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


# ---- goals and notes --------------------------------------------------------------------------------------
def _goal(goal: str, measured: str, target: str, met: Optional[bool], spread: Optional[Sequence[float]] = None,
          target_value: Optional[float] = None) -> Dict[str, Any]:
    return {"goal": goal, "measured": measured, "target": target, "met": met,
            "spread": None if spread is None else list(spread), "straddles": straddles(spread, target_value)}


def _update_goals(u: Dict[str, Any], where: str, timing: bool = True) -> List[Dict[str, Any]]:
    """The goals of one update run: odb's padding share (padded and packed), its update time against TRL's
    (``timing``), and every arm training the same rows to the same gradient."""
    trl = u["arms"]["trl"]
    out = []
    for arm, layout, most in (("odb", "padded", PADDING_MAX), ("odb_packed", "packed", PACKED_PADDING_MAX)):
        pad = u["arms"][arm]["padding_share"]
        out.append(_goal(f"rl_update ({where}): odb {layout}, padding share",
                         f"{pad:.3f} (TRL as is {trl['padding_share']:.3f})", f"<= {most}", pad <= most))
    for arm, layout in (("odb", "padded"), ("odb_packed", "packed")) if timing else ():
        ratio, spread = u["ratios"][arm], u["ratio_spreads"][arm]
        out.append(_goal(f"rl_update ({where}): update seconds, odb {layout} / TRL at equal rollouts",
                         f"{ratio:.2f}" + spread_text(spread), f"<= {TIME_RATIO_MAX}", ratio <= TIME_RATIO_MAX,
                         spread, TIME_RATIO_MAX))
    out.append(_goal(f"rl_update ({where}): every arm trains the same rows to the same gradient",
                     f"{'same' if u['same_rows'] else 'OTHER'} rows; largest relative gradient gap "
                     f"{u['grad_rel_gap']:.1e}", f"same rows, gap <= {GRAD_GAP_MAX:g}",
                     bool(u["same_rows"]) and u["grad_rel_gap"] <= GRAD_GAP_MAX))
    return out


def goals(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The section's goals (issues 32 and 43): for the update and its vLLM-style variant, odb's padding share
    (padded and packed), its update time against TRL's at equal rollouts, every arm training the same rows to the
    same gradient; for the bnpo variant the same rows and gradient with rows moving; TRL's padding share today (a
    reference); and, planning only, the step efficiency of bnpo and the entropy bonus at 8-128 ranks."""
    u = result["update"]
    where = f"GRPO policy update, {u['world']} process(es)"
    out = _update_goals(u, where)
    out[-1]["goal"] = "rl_update: every arm trains the same rows to the same gradient"
    out.append(_goal(f"rl_update ({where}): TRL's padding share today (reference)",
                     f"{u['arms']['trl']['padding_share']:.3f}", "-", None))
    for name, v in (result.get("updates") or {}).items():
        label = {"vllm": "vLLM-style rollouts, correction on", "bnpo": "loss_type bnpo, rows moving"}[name]
        out += _update_goals(v, f"GRPO policy update, {label}, {v['world']} process(es)", timing=name == "vllm")
    plans = (result.get("planning") or {}).get("loss_types")
    if plans:
        for loss in ("bnpo", "entropy bonus"):
            for layout in ("padded", "packed"):
                worst = min(row[loss][layout]["min"] for row in plans.values())
                each = ", ".join(f"{w}: {row[loss][layout]['median']:.3f}" for w, row in plans.items())
                out.append(_goal(f"rl_update planning: {loss}, DDP step efficiency with rows moving ({layout}), "
                                 f"{min(map(int, plans))}-{max(map(int, plans))} simulated ranks",
                                 f"medians {each}; lowest step {worst:.3f}", f">= {STEP_EFFICIENCY_MIN}",
                                 worst >= STEP_EFFICIENCY_MIN))
    return out


def notes(result: Dict[str, Any]) -> List[str]:
    """What the section does and every exception to it."""
    u = result["update"]
    s = u["settings"]
    p_med, p_sig, p_lo, p_hi = s["prompt"]
    c_med, c_sig, c_hi = s["completion"]
    m = s["model"]
    out = [
        f"Update timing: {s['rows']} rollout rows per rank and optimizer step ({s['rows'] // s['generations']} prompts "
        f"x num_generations={s['generations']}), prompts log-normal (median {p_med}, sigma {p_sig}) clipped to "
        f"[{p_lo}, {p_hi}] tokens, completions log-normal (median {c_med}, sigma {c_sig}) clipped to "
        f"max_completion_length={c_hi}; random token ids, advantages normalised per group; {s['steps']} steps, the "
        f"same rollouts for every arm (drawn once from seed {s['seed']}; TRL's _compute_loss sees the same rows in "
        "every arm, checked per row). No generation runs: the rollouts are the dict TRL's _prepare_inputs hands the loss.",
        f"Memory cap: token_budget={s['budget']} = per_device_train_batch_size {s['trl_rows']} x ({p_hi} + "
        f"{c_hi}), the largest TRL slice whose worst case fits it. TRL as is: per_device_train_batch_size="
        f"{s['trl_rows']}, gradient_accumulation_steps = steps_per_generation = {s['rows'] // s['trl_rows']}. odb: "
        f"per_device_train_batch_size={s['rows']}, 1 accumulation step, enable_odb(trainer, token_budget="
        f"{s['budget']}, layout='padded' / 'packed'). GRPOConfig defaults otherwise (loss_type {s['loss_type']}, beta 0, num_iterations 1).",
        f"Model: Llama from a config ({m['num_hidden_layers']} layers x {m['hidden_size']} hidden, vocabulary "
        f"{m['vocab_size']}), random weights, float32, sdpa attention, CPU, {s['threads']} thread per process. "
        f"Timed: each step's policy update (compute_loss + backward per slice or micro-batch, no_sync but the last; "
        f"no optimizer step), from a barrier to a barrier, after one untimed warm-up per arm; {s['rounds']} "
        f"interleaved rounds (arm order rotated), seconds per optimizer step, median (min-max).",
        "odb's arms run a row's prompt and completion without TRL's gap between them: padded, rows right-padded "
        "to the micro-batch's longest prompt + completion; packed, the micro-batch's rollouts in one row with "
        "restarting position_ids. enable_odb(layout='packed') switches the model's attention to odb's per-sample "
        "odb_varlen (the model is shared by the arms: padded batches, TRL's and odb padded's, still run "
        "transformers' sdpa under that name).",
    ]
    moved = [f"{ARM_LABELS[arm]}: step_plan '{a['step_plan']}', {a['moved_rows_per_step']:.1f} rows "
             f"({a['moved_bytes_per_step'] / 1e3:.1f} kB) moved between ranks per optimizer step"
             for arm, a in u["arms"].items() if "moved_rows_per_step" in a]
    if moved:
        out.append("Rows moved (enable_odb's default step_plan='auto'; a rank's loss holds rows of the other's slice "
                   "where that evens the ranks' costs): " + "; ".join(moved) + ".")
    if u.get("fallback"):
        out.append(f"1 PROCESS ONLY: {u['fallback']}.")
    for name, v in (result.get("updates") or {}).items():
        if name == "vllm":
            c = v["settings"]["vllm"]
            out.append(f"Variant {VARIANT_LABELS[name]}: the same rollouts, each with what TRL's generation adds "
                       f"when vLLM sampled it and the correction is on: old_per_token_logps (the policy's, before the "
                       f"update), sampling_per_token_logps (the policy's plus a normal offset of sd {c['noise']} per "
                       f"token: a sampler unlike the trainer) and importance_sampling_ratio (TRL's formula, mode "
                       f"{c['mode']}, clip_min {c['clip_min']}, clip_max {c['clip_max']}); every trainer runs TRL's "
                       f"loss with use_vllm=True and the correction. No vLLM runs (no generation runs at all).")
        else:
            out.append(f"Variant {VARIANT_LABELS[name]}: the same rollouts and arms, GRPOConfig(loss_type='bnpo'). "
                       f"bnpo is a token mean per slice, so TRL's per_device_train_batch_size is part of its "
                       f"objective: odb's arms keep TRL's slices ({s['trl_rows']} rows, {s['rows'] // s['trl_rows']} "
                       f"accumulation steps) and cut each, rows moving between the ranks (step_plan "
                       f"'{v['arms']['odb']['step_plan']}', each row weighted by its own slice's loss tokens); its "
                       f"gain is the padding each slice sheds.")
        if v.get("fallback"):
            out.append(f"1 PROCESS ONLY ({name}): {v['fallback']}.")
    pl = result.get("planning")
    if pl:
        q = pl["settings"]
        out.append(
            f"Planning only (no model): {q['rows']} rows per rank ({q['rows'] // q['generations']} prompts x "
            f"{q['generations']}), prompts log-normal (median {q['prompt'][0]}, sigma {q['prompt'][1]}) in "
            f"[{q['prompt'][2]}, {q['prompt'][3]}], completions log-normal (median {q['completion'][0]}, sigma "
            f"{q['completion'][1]}) clipped to {q['completion'][2]}; token_budget {q['budget']} (TRL's slice "
            f"{q['trl_rows']} rows), overhead {q['overhead']} tokens per micro-batch (odb.bench.scale's); steps per "
            "world size " + ", ".join(f"{w}: {k}" for w, k in q["steps"].items()) + ", median (min-max) over steps.")
        out.append("verl-style: the step's rows in W equal-size sets of balanced token sums (Karmarkar-Karp's largest "
                   "differencing, balanced variant, written from the algorithm's description), set r trained by rank "
                   "r, so rows move between ranks; each rank's rows in M micro-batches of balanced token sums (KK), M "
                   "the largest any rank needs (ceil of its tokens / budget), raised until every micro-batch fits; a "
                   "micro-batch costs its real tokens (packed). Its plan ms: the balance plus the mean rank's own "
                   "split.")
        out.append("odb global (padded and packed): what enable_odb runs on several ranks (step_plan='auto' -> "
                   "'global' for every loss_type, the entropy bonus too): plan_rollout_global, i.e. "
                   "plan_global_step over all ranks' rows, each row's prompt + completion as one length (odb's "
                   "layouts run a row without the gap), then no empty micro-batch (a rank's costliest split), rows "
                   "kept home where it costs nothing and the rank-local plan where it costs no more; rows move "
                   "between ranks. odb rollout plan (padded and packed): step_plan='rank' (plan_rollout_steps over "
                   "every rank's lengths; rows stay on their rank; the same rows per micro-step on every rank). Both "
                   "plan with the trainer's micro_batch_cost (budget / 16). TRL: each rank's generation batch padded "
                   "to its own widths (longest prompt + longest completion), shuffled, cut in equal slices. plan ms: "
                   "one rank's.")
        if pl.get("loss_types"):
            out.append("Per loss type (" + ", ".join(LOSS_PLANS) + "): the plan enable_odb takes with its default "
                       "step_plan='auto' on W ranks is the same for every one ('global': a row's weight carries its "
                       "own slice's normaliser, so the plan does not depend on the loss), and so is its step "
                       "efficiency, the odb global arms'. Before, bnpo and the entropy bonus kept their rows on their "
                       "rank (odb rollout plan).")
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
