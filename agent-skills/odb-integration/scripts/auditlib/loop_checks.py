"""Checks of each loop over an odb loader: pop, order, loss scale, ghosts, accumulation, set_epoch.

Also the Accelerate-specific ones (configure_accelerator, scale_loss, matching
accumulation), since under Accelerate the user writes the loop. Read with ``ast`` only.
"""

from __future__ import annotations

import ast
from typing import List

from detect_framework import dotted

from .loaders import (UNKNOWN, LoaderSite, batch_target, call_args, enclosing_function, enclosing_loop, literal,
                      loops_over, odb_name)
from .rules import HF_FRAMEWORKS, POP_FIX, Context, Finding, is_eval_site
from .steps import Step, scan_step


def check_loops(ctx: Context) -> List[Finding]:
    out: List[Finding] = []
    if ctx.framework in HF_FRAMEWORKS + ("lightning",):  # LLaMA-Factory's loader mode leaves the loop to you
        return out
    has_set_epoch = bool(ctx.calls_named("set_epoch"))
    for site in ctx.sites:
        if is_eval_site(site):
            continue
        loops = loops_over(ctx.index, site.names)
        # A name reused in another function usually holds another loader there.
        home = enclosing_function(ctx.index, site.call)
        loops = [loop for loop in loops if enclosing_function(ctx.index, loop) is home] or loops
        if not loops:
            out.append(ctx.finding("no-loop", site.call, "no `for batch in <loader>` loop over this odb loader was "
                                   "found, so the step checks (pop, loss scale, ghosts, accumulation) were skipped.",
                                   "iterate it as `for batch in loader:` in this file, or audit the file that does"))
        for loop in loops:
            step = scan_step(ctx.index, loop)
            out += _step_findings(ctx, site, loop, step)
            if (site.loader_args is not None and site.loader_args.get("sampler") is not None
                    and enclosing_loop(ctx.index, loop) is not None and not has_set_epoch):
                out.append(ctx.finding("set-epoch", loop, "the loader is iterated once per epoch but set_epoch is "
                                       "never called: its sampler shuffles every epoch the same way.",
                                       "call loader.set_epoch(epoch) before each epoch (it reaches the sampler)"))
    return out


def _step_findings(ctx: Context, site: LoaderSite, loop: ast.AST, step: Step) -> List[Finding]:
    out = []
    _, unpacked = batch_target(loop)
    if not step.pops and not (step.backwards or step.early_uses):
        return out  # the loop only iterates (counting, timing): nothing reaches a model
    if not step.pops:
        why = (f"the loop unpacks each batch (`{ast.get_source_segment(ctx.index.source, unpacked)}`), which drops "
               "the step info riding on it, so the loss is never scaled by info.loss_scale" if unpacked is not None
               else "batches never go through odb.pop_step_info: the batch keeps odb's metadata (model(**batch) "
                    "gets an unexpected keyword 'odb_step_info') and the loss is never scaled by info.loss_scale")
        out.append(ctx.finding("step-info", loop, f"{why}.",
                               ("iterate `for batch in loader:`, pop, then unpack; " if unpacked is not None else "")
                               + POP_FIX))
        return out
    if step.early_uses:
        use = step.early_uses[0]
        out.append(ctx.finding("step-info-order", use, "the batch is used whole before odb.pop_step_info: it still "
                               "holds 'odb_step_info' (model(**batch) gets an unexpected keyword, .to() fails).",
                               POP_FIX))
    if step.backwards and not step.scaled and not step.divided:
        out.append(ctx.finding("loss-scale", step.backwards[0], "the loss is not multiplied by info.loss_scale: "
                               "batches of different sizes weigh the same, ghost batches add gradient.",
                               "loss = odb.scale_loss(model(**batch).loss, info) before backward"))
    if (ctx.framework == "accelerate" and step.scaled and accelerator_accumulation(ctx) not in (1, None)
            and not any(_is_scale_loss(ctx, n) for n in step.scaled)
            and any(b.args for b in step.backwards)):  # accelerator.backward(loss), not loss.backward()
        out.append(ctx.finding("loss-scale", step.scaled[0], "accelerator.backward divides the loss by "
                               "gradient_accumulation_steps, which info.loss_scale already accounts for: the "
                               "gradient comes out K times too small.",
                               "accelerator.backward(scale_loss(accelerator, loss, info)) with "
                               "`from odb.integrations.accelerate import scale_loss`"))
    for node in step.divided:
        out.append(ctx.finding("loss-scale", node, "the loss is divided by info.loss_scale (ghosts give 0).",
                               "multiply: loss = loss * info.loss_scale"))
    for node in step.ghost_skips:
        out.append(ctx.finding("ghost-skip", node, "a branch on is_ghost skips the forward, backward or optimizer "
                               "step: under DDP the other ranks then wait in the gradient all-reduce.",
                               "remove the branch: a ghost batch has loss_scale 0, so running it adds no gradient "
                               "and keeps every rank's collectives aligned"))
    out += _accumulation_findings(ctx, site, loop, step)
    return out


def _is_scale_loss(ctx: Context, node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (odb_name(ctx.index, node.func) or "").endswith(".scale_loss")


def _accumulation_findings(ctx: Context, site: LoaderSite, loop: ast.AST, step: Step) -> List[Finding]:
    gas_node = site.options.get("gradient_accumulation_steps")
    gas = literal(ctx.index, gas_node) if gas_node is not None else (UNKNOWN if site.options_open else 1)
    conditional = [(c, tests) for c, tests in step.optimizer_steps if tests]
    counted = [c for c, tests in conditional
               if any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mod) or "accum" in (dotted(n) or "").lower()
                      for t in tests for n in ast.walk(t))]
    accumulates = bool(counted) or _accelerator_accumulates(ctx)  # accelerator.accumulate() with K=1 is a no-op
    if accumulates and gas_node is None and not site.options_open:
        where = counted[0] if counted else step.accumulate_blocks[0] if step.accumulate_blocks else loop
        return [ctx.finding("grad-accum", where, "the loop accumulates gradients over several micro-batches but odb "
                            "was not told: info.loss_scale then normalises each micro-batch on its own and the "
                            "gradient is about K times too large.",
                            f"pass gradient_accumulation_steps=K to {site.label}(...) (the loop's K) and step the "
                            "optimizer on `if info.is_last_micro_step:`")]
    acc = accelerator_accumulation(ctx)
    if isinstance(acc, int) and isinstance(gas, int) and acc != gas:
        return [ctx.finding("grad-accum", site.call, f"the Accelerator accumulates {acc} micro-batches but odb plans "
                            f"gradient_accumulation_steps={gas}: configure_accelerator refuses this at run time.",
                            f"pass gradient_accumulation_steps={acc} to {site.label}(...)")]
    if counted and gas_node is not None:
        return [ctx.finding("grad-accum", counted[0], "the optimizer steps on a counter while odb closes its own "
                            "accumulation windows (the last one of an epoch is shorter): the two drift apart.",
                            "step on `if info.is_last_micro_step:`")]
    batch = users_batch(ctx, site)
    if (isinstance(batch, int) and isinstance(gas, int) and batch * gas > 1 and step.optimizer_steps
            and not conditional and not step.accumulate_blocks):
        return [ctx.finding("grad-accum", step.optimizer_steps[0][0], f"odb keeps your batch ({batch} samples per "
                            f"rank x {gas} accumulated) in each optimizer step and cuts it into micro-batches under "
                            f"the token budget, but the optimizer steps after every micro-batch: each update then "
                            f"holds a part of your batch.", "step on `if info.is_last_micro_step:`")]
    if (isinstance(gas, int) and gas > 1 and step.optimizer_steps and not conditional
            and not step.accumulate_blocks):
        return [ctx.finding("grad-accum", step.optimizer_steps[0][0], f"odb was told gradient_accumulation_steps="
                            f"{gas} but the optimizer steps after every micro-batch: each step's loss is "
                            f"normalised by {gas} micro-batches' tokens.",
                            "step on `if info.is_last_micro_step:` or drop gradient_accumulation_steps")]
    return []


def users_batch(ctx: Context, site: LoaderSite):
    """The user's batch odb keeps per optimizer step and rank (``ODBDataLoader(batch_size=B)``, the loader
    ``odb.apply`` converts: its batch_size, 1 for None), as a literal or UNKNOWN; None where odb fills steps to
    the budget (batch_size left out of ODBDataLoader, ``global_batch_size=None``) or a global_batch_size is given."""
    if "global_batch_size" in site.options:
        return None
    if site.kind == "ODBDataLoader":
        node = (site.loader_args or {}).get("batch_size")
        return None if node is None else literal(ctx.index, node)
    if site.loader_args is None:
        return UNKNOWN
    node = site.loader_args.get("batch_size")
    value = 1 if node is None else literal(ctx.index, node)
    return 1 if value is None else value


def accelerator_accumulation(ctx: Context):
    """The Accelerator's gradient_accumulation_steps: a literal, UNKNOWN, or None without an Accelerator."""
    for call in ctx.index.calls():
        if (ctx.index.qualname(call.func) or "").split(".")[-1] == "Accelerator":
            args, is_open = call_args(call, ("device_placement", "split_batches", "mixed_precision",
                                             "gradient_accumulation_steps"))
            if "gradient_accumulation_steps" in args:
                return literal(ctx.index, args["gradient_accumulation_steps"])
            return UNKNOWN if is_open else 1
    return None


def _accelerator_accumulates(ctx: Context) -> bool:
    return accelerator_accumulation(ctx) not in (1, None)


def check_integration_missing(ctx: Context) -> List[Finding]:
    if ctx.framework != "accelerate" or any(n.endswith(".configure_accelerator") for n, _ in ctx.integrations):
        return []
    return [ctx.finding("integration-missing", site.call, "the odb loader is used under Accelerate without "
                        "configure_accelerator: accelerator.prepare rebuilds a DataLoader around its own batch "
                        "sampler and throws odb's batches away.",
                        "loader = configure_accelerator(accelerator, loader) (from odb.integrations.accelerate) "
                        "before accelerator.prepare") for site in ctx.sites if not is_eval_site(site)]
