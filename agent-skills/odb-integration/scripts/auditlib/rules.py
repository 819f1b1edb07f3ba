"""The rule table of audit_integration.py, what a finding is, and what every check reads.

RULES is what ``audit_integration.py --list-rules`` prints and SKILL.md documents;
``Context`` holds the parsed script, the detected framework, the odb loaders found
(``loaders.loader_sites``) and the uses of ``odb.integrations``.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from typing import Dict, List, Tuple

from detect_framework import ScriptIndex, dotted

from .loaders import LoaderSite, odb_name

RULES: Dict[str, Tuple[str, str]] = {
    "odb-missing": ("error", "odb is used: an odb loader / odb.apply, or the framework's integration"),
    "token-budget": ("error", "every odb entry point gets token_budget (or config=ODBConfig(...))"),
    "batch-size": ("error", "the loader odb plans has no batch_sampler (its batch_size is your batch)"),
    "num-workers": ("warning", "num_workers > 0, so samples are processed while the model trains"),
    "step-info": ("error", "every batch goes through odb.pop_step_info (iterate the batch whole, not unpacked)"),
    "step-info-order": ("error", "the step info is popped before the batch is used whole (model(**batch), .to())"),
    "loss-scale": ("error", "the loss is multiplied by info.loss_scale before backward"),
    "ghost-skip": ("error", "ghost batches run forward, backward and optimizer step like any other batch"),
    "join": ("error", "join=False only together with torch.distributed.algorithms.Join"),
    "ddp-sampler": ("error", "under DDP the loader shards the data (DistributedSampler or odb.ShardSampler)"),
    "set-epoch": ("warning", "a loader with a sampler iterated over several epochs gets loader.set_epoch(epoch)"),
    "grad-accum": ("error", "odb's gradient_accumulation_steps matches how the loop steps the optimizer, which "
                            "steps on info.is_last_micro_step where a step holds several micro-batches"),
    "eval-loader": ("warning", "evaluation loaders stay ordinary loaders"),
    "integration-order": ("error", "the integration is enabled before training starts"),
    "mixin-order": ("error", "ODBTrainerMixin comes before the Trainer class it extends"),
    "integration-missing": ("error", "the framework's odb hook is there beside the loader (configure_accelerator, "
                                     "the Lightning callback)"),
    "trainer-args": ("error", "TrainingArguments leave batch sizes to odb (no auto_find_batch_size), and a "
                              "length-grouping strategy keeps the Trainer's steps (no global_batch_size or "
                              "composition for odb)"),
    "no-loop": ("info", "a loop over the odb loader was found (else the loop checks were skipped)"),
}

POP_FIX = ("first line of the loop body: `info = odb.pop_step_info(batch)`, then "
           "`loss = odb.scale_loss(model(**batch).loss, info)`")
MISSING_FIX = {
    "plain_loop": "loader = odb.ODBDataLoader(dataset, token_budget=16384, num_workers=4, collate_fn=collate_fn) "
                  "and, in the loop, " + POP_FIX + " (references/plain_loop.md)",
    "ddp": "loader = odb.ODBDataLoader(dataset, token_budget=16384, sampler=DistributedSampler(dataset), "
           "num_workers=4, collate_fn=collate_fn) and, in the loop, " + POP_FIX + " (references/ddp.md)",
    "hf_trainer": "from odb.integrations.hf import enable_odb; enable_odb(trainer, token_budget=16384) before "
                  "trainer.train() (references/hf_trainer.md)",
    "seq2seq_trainer": "from odb.integrations.hf import enable_odb; enable_odb(trainer, token_budget=16384) before "
                       "trainer.train() (references/hf_trainer.md)",
    "llamafactory": "odb.integrations.llamafactory.enable_odb(trainer=trainer, token_budget=16384) before "
                    "trainer.train(); or run_exp(args, token_budget=16384) in place of llamafactory-cli train; or "
                    "enable_odb(train_dataloader=loader, training_args=args, token_budget=16384) for a loop of "
                    "your own (references/llamafactory.md)",
    "accelerate": "loader = odb.ODBDataLoader(...); odb.integrations.accelerate.configure_accelerator(accelerator, "
                  "loader); in the loop " + POP_FIX + " (references/accelerate.md)",
    "lightning": "return ODBLightningLoader(odb.ODBDataLoader(..., sampler=odb.ShardSampler(ds))) from "
                 "train_dataloader(), Trainer(callbacks=[ODBCallback()]), and `return scale_loss(self, loss)` in "
                 "training_step (odb.integrations.lightning; references/lightning.md)",
    "unknown": "build the training loader with odb.ODBDataLoader(dataset, token_budget=...) (SKILL.md)",
}
_HF = ("integrations.hf.enable_odb", "integrations.hf.ODBTrainer", "integrations.hf.ODBTrainerMixin",
       "integrations.trl.enable_odb")  # TRL's SFTTrainer is a transformers Trainer
ENABLERS = {  # the integration calls that switch odb on (an import alone does not)
    "hf_trainer": _HF, "seq2seq_trainer": _HF,
    "llamafactory": ("integrations.llamafactory.enable_odb", "integrations.llamafactory.run_exp"),
    "accelerate": ("integrations.accelerate.configure_accelerator",),
    "lightning": ("integrations.lightning.ODBLightningLoader", "integrations.lightning.ODBCallback"),
}
HF_FRAMEWORKS = ("hf_trainer", "seq2seq_trainer")
TRAINER_FRAMEWORKS = ("hf_trainer", "seq2seq_trainer", "llamafactory")
EVAL_WORDS = {"eval", "evaluation", "val", "valid", "validation", "test", "dev", "predict"}


@dataclass
class Finding:
    rule: str
    severity: str
    line: int
    message: str
    fix: str
    code: str = ""


@dataclass
class Context:
    index: ScriptIndex
    framework: str
    distributed: bool
    sites: List[LoaderSite]
    integrations: List[Tuple[str, ast.AST]]  # (e.g. "integrations.hf.enable_odb", call or class node)

    def finding(self, rule: str, node_or_line, message: str, fix: str) -> Finding:
        line = node_or_line if isinstance(node_or_line, int) else node_or_line.lineno
        return Finding(rule, RULES[rule][0], line, message, fix, self.index.line(line))

    def integration_enabled(self) -> bool:
        """Whether the framework's odb integration is switched on (not merely imported)."""
        return any(name in ENABLERS.get(self.framework, ()) for name, _ in self.integrations)

    def calls_named(self, last: str) -> List[ast.Call]:
        return [c for c in self.index.calls() if isinstance(c.func, (ast.Name, ast.Attribute))
                and (c.func.id if isinstance(c.func, ast.Name) else c.func.attr) == last]


def integration_uses(index: ScriptIndex) -> List[Tuple[str, ast.AST]]:
    out: List[Tuple[str, ast.AST]] = []
    for node in ast.walk(index.tree):
        refs = [node.func] if isinstance(node, ast.Call) else node.bases if isinstance(node, ast.ClassDef) else []
        for ref in refs:
            name = odb_name(index, ref)
            if name and name.startswith("integrations."):
                out.append((name, node))
    return sorted(out, key=lambda u: u[1].lineno)


def is_eval_site(site: LoaderSite) -> bool:
    names = set(site.names)
    if site.target is not None:
        target = site.target
        names.add(dotted(target.func if isinstance(target, ast.Call) else target) or "")
    words = {w for n in names for w in re.split(r"[^a-z]+|(?<=[a-z])(?=loader|dl|data)", n.lower()) if w}
    return bool(words & EVAL_WORDS)
