"""Checks of the odb loaders themselves: used at all, token budget, batch size, workers, eval, sharding.

Read with ``ast`` only; each check takes the Context of rules.py and returns findings.
"""

from __future__ import annotations

import ast
from typing import List, Optional

from detect_framework import ScriptIndex, framework_of, training_loops

from .loaders import UNKNOWN, literal, resolve_call
from .rules import HF_FRAMEWORKS, MISSING_FIX, TRAINER_FRAMEWORKS, Context, Finding, is_eval_site


WHY_MISSING = {
    "hf_trainer": "the Trainer builds its own train loader, and no odb.integrations.hf entry point changes it",
    "seq2seq_trainer": "the Seq2SeqTrainer builds its own train loader, and no odb.integrations.hf entry point "
                       "changes it",
    "llamafactory": "LLaMA-Factory builds its own train loader, and neither enable_odb nor run_exp of "
                    "odb.integrations.llamafactory is used",
    "unknown": "this file has no training loop (no loop calling .backward()), no known trainer and no odb loader; "
               "audit the file that trains",
}


def check_odb_missing(ctx: Context) -> List[Finding]:
    train_sites = [s for s in ctx.sites if not is_eval_site(s)]
    # Trainers build their own loader: only the integration counts. Elsewhere a loader built in another
    # module still shows through the integration's hooks (configure_accelerator, ODBCallback).
    used = ctx.integration_enabled() or (ctx.framework not in TRAINER_FRAMEWORKS and bool(train_sites))
    if used:
        return []
    anchor = _framework_anchor(ctx)
    what = WHY_MISSING.get(ctx.framework, "no odb loader (odb.ODBDataLoader / odb.apply) feeds the training loop")
    return [ctx.finding("odb-missing", anchor, f"odb is not used: {what}.", MISSING_FIX[ctx.framework])]


def _framework_anchor(ctx: Context) -> int:
    for call in ctx.index.calls():
        q = ctx.index.qualname(call.func)
        if q and framework_of(q) == ctx.framework:
            return call.lineno
    loops = training_loops(ctx.index)
    return loops[0].lineno if loops else 1


def check_token_budget(ctx: Context) -> List[Finding]:
    out = []
    for site in ctx.sites:
        if "token_budget" not in site.options and "config" not in site.options and not site.options_open:
            out.append(ctx.finding("token-budget", site.call, f"{site.label}(...) has no token_budget.",
                                   "pass token_budget=16384 (padded tokens per micro-batch, B x L; start from the "
                                   "largest fixed batch x max length that fit memory)"))
    return out


def check_loader_args(ctx: Context) -> List[Finding]:
    out = []
    for site in ctx.sites:
        args = site.loader_args
        if args is None:
            continue
        if "batch_sampler" in args and literal(ctx.index, args["batch_sampler"]) is not None:
            out.append(ctx.finding("batch-size", site.loader_line, "the loader odb plans has a batch_sampler: odb "
                                   "reads your batch from the sampler and batch_size, and cuts each optimizer step "
                                   "into micro-batches itself.",
                                   "drop batch_sampler; pass sampler= and batch_size=B (your batch) instead"))
        workers = literal(ctx.index, args["num_workers"]) if "num_workers" in args else 0
        if workers == 0 and not ("num_workers" not in args and site.loader_open) and not is_eval_site(site):
            out.append(ctx.finding("num-workers", site.loader_line, "num_workers is 0: every sample is processed "
                                   "in the training process, between steps.",
                                   "pass num_workers=4 (or more; odb buffers their output and plans over it)"))
    return out


def check_eval_loaders(ctx: Context) -> List[Finding]:
    return [ctx.finding("eval-loader", site.call, f"{site.label} is used on what looks like an evaluation "
                        f"loader ({', '.join(sorted(site.names)) or 'its argument'}).",
                        "keep evaluation loaders ordinary DataLoaders: odb plans training steps (ghost steps, "
                        "loss scale); evaluate with a fixed batch size") for site in ctx.sites if is_eval_site(site)]


def check_distributed(ctx: Context) -> List[Finding]:
    # Accelerate and Lightning scripts run on several processes and shard no odb loader themselves.
    if not (ctx.distributed or ctx.framework in ("accelerate", "lightning")) or ctx.framework in HF_FRAMEWORKS:
        return []
    out = []
    uses_join = any((ctx.index.qualname(c.func) or "").split(".")[-1] == "Join"
                    and (ctx.index.qualname(c.func) or "").startswith("torch") for c in ctx.index.calls())
    for site in ctx.sites:
        if is_eval_site(site):
            continue
        if "join" in site.options and literal(ctx.index, site.options["join"]) is False and not uses_join:
            out.append(ctx.finding("join", site.call, "join=False stops a rank as soon as its data ends, so the "
                                   "other ranks wait forever in their next gradient all-reduce.",
                                   "drop join=False (the default join=True keeps ranks aligned with ghost batches),"
                                   " or wrap the loop in `with torch.distributed.algorithms.Join([model]):`"))
        args = site.loader_args
        if args is None or (site.loader_open and "sampler" not in args):
            continue
        sampler = args.get("sampler")
        kind = _sampler_kind(ctx.index, sampler)
        if sampler is None and _iterable_dataset(ctx.index, args.get("dataset")):
            continue
        if sampler is None or kind in ("RandomSampler", "SequentialSampler", "WeightedRandomSampler"):
            what = "no sampler" if sampler is None else f"a {kind}"
            out.append(ctx.finding("ddp-sampler", site.loader_line, f"the script runs on several processes but "
                                   f"the odb loader has {what}: every rank iterates the whole dataset.",
                                   "pass sampler=DistributedSampler(dataset, shuffle=True) or "
                                   "sampler=odb.ShardSampler(dataset) (exactly once, no padding); an "
                                   "IterableDataset must shard by rank itself"))
    return out


def _sampler_kind(index: ScriptIndex, node: Optional[ast.AST]) -> Optional[str]:
    call = resolve_call(index, node)
    q = index.qualname(call.func) if call is not None else None
    return q.split(".")[-1] if q else None


def _iterable_dataset(index: ScriptIndex, node: Optional[ast.AST]) -> bool:
    call = resolve_call(index, node)
    if call is None or not isinstance(call.func, ast.Name):
        return False
    return any(a.endswith("IterableDataset") for a in index.ancestors(call.func.id))
