"""The rl_update section's goals and notes (``odb.bench.rl_update``): what each figure must reach, and what the
section did, from its results alone.

Example:
    >>> _goal("g", "0.1", "<= 0.15", True)["met"]
    True
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from odb.bench.verdict import spread_text, straddles

__all__ = ["GRAD_GAP_MAX", "PACKED_PADDING_MAX", "PADDING_MAX", "STEP_EFFICIENCY_MIN", "TIME_RATIO_MAX", "goals",
           "notes"]

PADDING_MAX, TIME_RATIO_MAX, GRAD_GAP_MAX = 0.15, 0.6, 1e-5
PACKED_PADDING_MAX = 0.02  # the goal for packed rows
STEP_EFFICIENCY_MIN = 0.95  # rows moving at 8-128 ranks, every loss type (bnpo and the entropy bonus included)


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
    labels = result.get("arm_labels", {})
    moved = [f"{labels.get(arm, arm)}: step_plan '{a['step_plan']}', {a['moved_rows_per_step']:.1f} rows "
             f"({a['moved_bytes_per_step'] / 1e3:.1f} kB) moved between ranks per optimizer step"
             for arm, a in u["arms"].items() if "moved_rows_per_step" in a]
    if moved:
        out.append("Rows moved (enable_odb's default step_plan='auto'; a rank's loss holds rows of the other's slice "
                   "where that evens the ranks' costs): " + "; ".join(moved) + ".")
    if u.get("fallback"):
        out.append(f"1 PROCESS ONLY: {u['fallback']}.")
    variants = result.get("variant_labels", {})
    for name, v in (result.get("updates") or {}).items():
        if name == "vllm":
            c = v["settings"]["vllm"]
            out.append(f"Variant {variants.get(name, name)}: the same rollouts, each with what TRL's generation adds "
                       f"when vLLM sampled it and the correction is on: old_per_token_logps (the policy's, before the "
                       f"update), sampling_per_token_logps (the policy's plus a normal offset of sd {c['noise']} per "
                       f"token: a sampler unlike the trainer) and importance_sampling_ratio (TRL's formula, mode "
                       f"{c['mode']}, clip_min {c['clip_min']}, clip_max {c['clip_max']}); every trainer runs TRL's "
                       f"loss with use_vllm=True and the correction. No vLLM runs (no generation runs at all).")
        else:
            out.append(f"Variant {variants.get(name, name)}: the same rollouts and arms, GRPOConfig(loss_type='bnpo'). "
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
            losses = next(iter(pl["loss_types"].values()))
            out.append("Per loss type (" + ", ".join(losses) + "): the plan enable_odb takes with its default "
                       "step_plan='auto' on W ranks is the same for every one ('global': a row's weight carries its "
                       "own slice's normaliser, so the plan does not depend on the loss), and so is its step "
                       "efficiency, the odb global arms'. Before, bnpo and the entropy bonus kept their rows on their "
                       "rank (odb rollout plan).")
    return out
