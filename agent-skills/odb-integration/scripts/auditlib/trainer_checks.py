"""Checks of the trainer integrations: HF Trainer / Seq2SeqTrainer, LLaMA-Factory, Lightning.

Read with ``ast`` only; each check takes the Context of rules.py and returns findings.
"""

from __future__ import annotations

import ast
from typing import List, Optional

from detect_framework import ScriptIndex, dotted, framework_of

from .loaders import UNKNOWN, call_args, enclosing_function, literal, odb_name
from .rules import HF_FRAMEWORKS, Context, Finding, is_eval_site
from .steps import scan_function

ARGS_CLASSES = ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig")
GROUPING = ("group_by_length", "batch_rebalance")


def check_integration_order(ctx: Context) -> List[Finding]:
    out = []
    for name, node in ctx.integrations:
        if not (isinstance(node, ast.Call) and name.endswith(".enable_odb")):
            continue
        trainer = _arg(node, 0, "trainer")
        owner = dotted(trainer) if trainer is not None else None
        if owner is None:
            continue
        for call in ctx.calls_named("train"):
            if (isinstance(call.func, ast.Attribute) and dotted(call.func.value) == owner
                    and call.lineno < node.lineno and _same_function(ctx.index, call, node)):
                out.append(ctx.finding("integration-order", node, f"{name.split('.')[-1]} runs after "
                                       f"{owner}.train() (L{call.lineno}): the first training run used the "
                                       "trainer's own loader.", f"call it before {owner}.train()"))
    return out


def check_mixin_order(ctx: Context) -> List[Finding]:
    out = []
    for cls in ctx.index.classes.values():
        names = [ctx.index.qualname(b) or "" for b in cls.bases]
        mixin = next((i for i, q in enumerate(names) if q.split(".")[0] == "odb" and q.endswith("Mixin")), None)
        trainer = next((i for i, q in enumerate(names) if framework_of(q) or q.split(".")[-1] in
                        ctx.index.classes and any(framework_of(a) for a in ctx.index.ancestors(q.split(".")[-1]))),
                       None)
        if mixin is not None and trainer is not None and mixin > trainer:
            out.append(ctx.finding("mixin-order", cls, f"class {cls.name} lists {names[mixin].split('.')[-1]} after "
                                   f"{names[trainer].split('.')[-1]}: the trainer's own methods win and odb is "
                                   "never called.", f"class {cls.name}({names[mixin].split('.')[-1]}, "
                                   f"{names[trainer].split('.')[-1]}): the mixin first"))
    return out


def _arg(call: ast.Call, pos: int, name: str) -> Optional[ast.AST]:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return call.args[pos] if len(call.args) > pos else None


def _same_function(index: ScriptIndex, a: ast.AST, b: ast.AST) -> bool:
    return enclosing_function(index, a) is enclosing_function(index, b)


def _hf_entry_calls(ctx: Context) -> List[ast.Call]:
    """enable_odb(...), ODBTrainer(...) and instantiations of local subclasses of the odb trainer classes."""
    odb_classes = {c.name for c in ctx.index.classes.values()
                   if any(a.startswith("odb.integrations.hf.") for a in ctx.index.ancestors(c.name))}
    out = []
    for call in ctx.index.calls():
        q = ctx.index.qualname(call.func) or ""
        if q in ("odb.integrations.hf.enable_odb", "odb.integrations.hf.ODBTrainer",
                 "odb.integrations.trl.enable_odb") or (
                isinstance(call.func, ast.Name) and call.func.id in odb_classes):
            out.append(call)
    return out


def _args_calls(ctx: Context) -> List[ast.Call]:
    return [c for c in ctx.index.calls() if (ctx.index.qualname(c.func) or "").split(".")[-1] in ARGS_CLASSES
            or (ctx.index.qualname(c.func) or "") == "odb.integrations.hf.configure_trainer"]


def check_hf(ctx: Context) -> List[Finding]:
    if ctx.framework not in HF_FRAMEWORKS:
        return []
    out: List[Finding] = []
    entries = _hf_entry_calls(ctx)
    for call in entries:
        args, is_open = call_args(call, ())
        enable = (ctx.index.qualname(call.func) or "").endswith(".enable_odb")
        if not is_open and not ({"token_budget", "config", "odb_config"} & set(args)) and not (
                enable and len(call.args) > 1):
            out.append(ctx.finding("token-budget", call, "the odb trainer entry point has no token_budget.",
                                   "pass token_budget=16384 (padded tokens per micro-batch; or config=/odb_config="
                                   "odb.ODBConfig(...))"))
    configured = any((ctx.index.qualname(c.func) or "").endswith("configure_trainer") for c in _args_calls(ctx))
    settings, any_open = {}, False
    for call in _args_calls(ctx):
        args, is_open = call_args(call, ())
        any_open = any_open or is_open
        settings.update({k: (v, call) for k, v in args.items()})
    workers = settings.get("dataloader_num_workers")
    if _args_calls(ctx) and not any_open and (workers is None or literal(ctx.index, workers[0]) == 0):
        anchor = workers[1] if workers else _args_calls(ctx)[0]
        out.append(ctx.finding("num-workers", anchor, "dataloader_num_workers is 0: odb's loader inherits it, so "
                               "samples are processed in the training process, between steps.",
                               "TrainingArguments(..., dataloader_num_workers=4)"))
    if not configured and "auto_find_batch_size" in settings and \
            literal(ctx.index, settings["auto_find_batch_size"][0]) is True:
        out.append(ctx.finding("trainer-args", settings["auto_find_batch_size"][1], "auto_find_batch_size=True is "
                               "refused by the odb Trainer (it sizes batches, which odb does).",
                               "drop auto_find_batch_size, or pass the arguments through "
                               "odb.integrations.hf.configure_trainer(args)"))
    strategy = settings.get("train_sampling_strategy")
    grouping = literal(ctx.index, strategy[0]) if strategy else None
    for call in entries if grouping in GROUPING else []:
        for key in sorted({"global_batch_size", "composition"} & set(call_args(call, ())[0])):
            out.append(ctx.finding("trainer-args", call, f"odb gets {key} with train_sampling_strategy="
                                   f"{grouping!r}, whose optimizer steps odb keeps: the odb Trainer refuses it.",
                                   f"leave {key} out (or train_sampling_strategy='random' for steps odb chooses)"))
    given = [(c, a["gradient_accumulation_steps"]) for c in entries
             for a in [call_args(c, ())[0]] if "gradient_accumulation_steps" in a]
    trainer_gas = settings.get("gradient_accumulation_steps")
    expected = literal(ctx.index, trainer_gas[0]) if trainer_gas else (UNKNOWN if any_open else 1)
    for call, node in given:
        value = literal(ctx.index, node)
        if value is not UNKNOWN and expected is not UNKNOWN and value not in (1, expected):
            out.append(ctx.finding("grad-accum", call, f"odb got gradient_accumulation_steps={value} but the "
                                   f"TrainingArguments accumulate {expected}: the odb Trainer refuses this.",
                                   "set gradient_accumulation_steps only in TrainingArguments (odb follows it)"))
    return out


def _lightning_trainers(ctx: Context) -> List[ast.Call]:
    return [c for c in ctx.index.calls() if framework_of(ctx.index.qualname(c.func) or "") == "lightning"
            and (ctx.index.qualname(c.func) or "").endswith(".Trainer")]


def _training_steps(ctx: Context) -> List[ast.FunctionDef]:
    out = []
    for cls in ctx.index.classes.values():
        if any(a.endswith("LightningModule") and framework_of(a) == "lightning" for a in ctx.index.ancestors(cls.name)):
            out += [f for f in cls.body if isinstance(f, ast.FunctionDef) and f.name == "training_step"]
    return out


def check_lightning(ctx: Context) -> List[Finding]:
    if ctx.framework != "lightning":
        return []
    out: List[Finding] = []
    uses = {name.split(".")[-1] for name, _ in ctx.integrations}
    sites = [s for s in ctx.sites if not is_eval_site(s)]
    for site in sites if "ODBLightningLoader" not in uses else []:
        out.append(ctx.finding("integration-missing", site.call, "the odb loader reaches Lightning unwrapped: "
                               "Lightning injects its DistributedSampler or rebuilds the loader, and ends the epoch "
                               "at odb's estimated len().", "return ODBLightningLoader(loader) from "
                               "train_dataloader() (from odb.integrations.lightning)"))
    trainers = _lightning_trainers(ctx)
    if "ODBLightningLoader" in uses and "ODBCallback" not in uses:
        for call in trainers:
            out.append(ctx.finding("integration-missing", call, "the Trainer has no ODBCallback: no step info reaches "
                                   "training_step (scale_loss raises) and odb's epoch is never set.",
                                   "Trainer(..., callbacks=[ODBCallback()]) (from odb.integrations.lightning)"))
    if not (sites or uses):
        return out  # odb-missing already says it
    accumulation = UNKNOWN
    for call in trainers:
        args, is_open = call_args(call, ())
        accumulation = literal(ctx.index, args["accumulate_grad_batches"]) if "accumulate_grad_batches" in args \
            else (UNKNOWN if is_open else 1)
    for method in _training_steps(ctx):
        params = [a.arg for a in method.args.args]
        step = scan_function(ctx.index, method, params[1] if len(params) > 1 else None)
        for pop in step.pops:
            out.append(ctx.finding("step-info", pop, "ODBLightningLoader already took the step info off the batch: "
                                   "popping again raises KeyError.", "read self.odb_step_info (set by ODBCallback), "
                                   "or just return scale_loss(self, loss)"))
        plain = [n for n in step.scaled if not (isinstance(n, ast.Call)
                                                and (odb_name(ctx.index, n.func) or "").endswith(".scale_loss"))]
        if not step.scaled:
            out.append(ctx.finding("loss-scale", method, "training_step returns the loss without odb's scale.",
                                   "return scale_loss(self, loss) (from odb.integrations.lightning)"))
        elif plain and len(plain) == len(step.scaled) and accumulation != 1:
            out.append(ctx.finding("loss-scale", plain[0], "Lightning divides the returned loss by "
                                   "accumulate_grad_batches, which loss_scale already accounts for.",
                                   "return scale_loss(self, loss): it cancels that division"))
        for node in step.ghost_skips:
            out.append(ctx.finding("ghost-skip", node, "training_step skips ghost batches (returning None skips "
                                   "backward): the other ranks wait in the all-reduce.",
                                   "remove the branch; a ghost's loss scale is 0"))
    for site in sites:
        gas_node = site.options.get("gradient_accumulation_steps")
        gas = literal(ctx.index, gas_node) if gas_node is not None else (UNKNOWN if site.options_open else 1)
        if isinstance(accumulation, int) and isinstance(gas, int) and gas != accumulation:
            out.append(ctx.finding("grad-accum", site.call, f"the Trainer accumulates {accumulation} batches but "
                                   f"the odb loader plans gradient_accumulation_steps={gas}: ODBCallback refuses "
                                   "this at run time.", f"pass gradient_accumulation_steps={accumulation} to the "
                                   "odb loader"))
    return out


def check_llamafactory(ctx: Context) -> List[Finding]:
    """Trainer mode and run_exp: token_budget given (loader mode is a loader site, checked as such)."""
    out = []
    for name, node in ctx.integrations:
        if not (isinstance(node, ast.Call) and name in ("integrations.llamafactory.enable_odb",
                                                        "integrations.llamafactory.run_exp")):
            continue
        positional = ("trainer", "train_dataloader", "training_args", "token_budget") \
            if name.endswith("enable_odb") else ("args", "callbacks")
        args, is_open = call_args(node, positional)
        if "train_dataloader" in args or is_open or {"token_budget", "config"} & set(args):
            continue
        out.append(ctx.finding("token-budget", node, f"{name.split('.')[-1]}(...) has no token_budget.",
                               "pass token_budget=16384 (padded tokens per micro-batch; at least cutoff_len)"))
    return out
