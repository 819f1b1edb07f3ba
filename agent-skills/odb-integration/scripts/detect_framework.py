#!/usr/bin/env python3
"""Which training framework a script uses, read with ``ast``: the script is never run or imported.

    python detect_framework.py train.py [--json]

Prints one of hf_trainer, seq2seq_trainer, llamafactory, accelerate, lightning, ddp,
plain_loop or unknown, the odb entry point for it, and the evidence lines that decided
it. Exit status: 0 when a framework was found, 1 for unknown, 2 when the file cannot be
read or parsed.

The module also holds the small ``ast`` index (imports, aliases, class bases) that
audit_integration.py builds on. Standard library only; Python 3.8+.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import asdict, dataclass, field
from typing import Dict, Iterator, List, Optional, Set

# Most specific first: a script that builds a Seq2SeqTrainer also "uses transformers".
PRIORITY = ("llamafactory", "seq2seq_trainer", "hf_trainer", "lightning", "accelerate", "ddp", "plain_loop")

ENTRY_POINTS = {
    "plain_loop": "odb.ODBDataLoader(dataset, token_budget=..., num_workers=4, collate_fn=...) "
                  "+ info = odb.pop_step_info(batch); loss = model(**batch).loss * info.loss_scale",
    "ddp": "odb.ODBDataLoader(dataset, token_budget=..., sampler=DistributedSampler(dataset) or "
           "odb.ShardSampler(dataset), ...) + pop_step_info / loss_scale; keep ghost steps",
    "hf_trainer": "odb.integrations.hf.enable_odb(trainer, token_budget=...) before trainer.train() "
                  "(or ODBTrainer(..., token_budget=...), or class T(ODBTrainerMixin, Trainer))",
    "seq2seq_trainer": "odb.integrations.hf.enable_odb(trainer, token_budget=...) before trainer.train() "
                       "(length_fn=odb.seq2seq_lengths for source+target budgets)",
    "llamafactory": "odb.integrations.llamafactory.enable_odb(trainer=trainer, token_budget=...) before "
                    "trainer.train(), or odb.integrations.llamafactory.run_exp(args, token_budget=...) for "
                    "llamafactory-cli configs",
    "accelerate": "odb.ODBDataLoader(..., sampler=odb.ShardSampler(ds)) + loader = odb.integrations.accelerate."
                  "configure_accelerator(accelerator, loader); "
                  "accelerator.backward(scale_loss(accelerator, loss, info))",
    "lightning": "train_dataloader() returns odb.integrations.lightning.ODBLightningLoader(odb.ODBDataLoader(...)); "
                 "Trainer(callbacks=[ODBCallback()]); training_step returns scale_loss(self, loss)",
    "unknown": "no training loop found: see SKILL.md, decision table",
}

REFERENCES = {
    "plain_loop": "references/plain_loop.md", "ddp": "references/ddp.md", "hf_trainer": "references/hf_trainer.md",
    "seq2seq_trainer": "references/hf_trainer.md", "llamafactory": "references/llamafactory.md",
    "accelerate": "references/accelerate.md", "lightning": "references/lightning.md", "unknown": "SKILL.md",
}

_LLAMAFACTORY_TRAINERS = {"CustomSeq2SeqTrainer", "CustomTrainer", "CustomDPOTrainer", "CustomKTOTrainer",
                          "CustomPPOTrainer", "PairwiseTrainer"}
_ODB_INTEGRATIONS = {"hf": "hf_trainer", "llamafactory": "llamafactory", "accelerate": "accelerate",
                     "lightning": "lightning"}
_LIGHTNING_ROOTS = ("lightning", "pytorch_lightning")
_LIGHTNING_NAMES = {"Trainer", "LightningModule", "LightningDataModule"}
_DDP_NAMES = {"DistributedDataParallel", "DistributedSampler", "FullyShardedDataParallel", "fully_shard",
              "ShardSampler"}


@dataclass
class Evidence:
    framework: str
    line: int
    code: str
    reason: str
    strong: bool  # used (called, subclassed); weak: only imported


@dataclass
class Detection:
    path: str
    framework: str
    frameworks: List[str]
    distributed: bool
    entry_point: str
    reference: str
    odb_used: List[str]
    evidence: List[Evidence] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


class ScriptIndex:
    """A parsed script with its import aliases, resolvable dotted names and local class bases."""

    def __init__(self, source: str, path: str = "<script>") -> None:
        self.path = path
        self.source = source
        self.lines = source.splitlines()
        self.tree = ast.parse(source, filename=path)
        self.aliases: Dict[str, str] = {}      # local name -> qualified name
        self.imports: List[ast.AST] = []
        self.classes: Dict[str, ast.ClassDef] = {}
        self.functions: Dict[str, ast.FunctionDef] = {}
        self.parents: Dict[ast.AST, ast.AST] = {}
        for node in ast.walk(self.tree):
            for child in ast.iter_child_nodes(node):
                self.parents[child] = node
            if isinstance(node, ast.Import):
                self.imports.append(node)
                for a in node.names:
                    if a.asname:
                        self.aliases[a.asname] = a.name
                    else:
                        root = a.name.split(".")[0]
                        self.aliases[root] = root
            elif isinstance(node, ast.ImportFrom):
                self.imports.append(node)
                module = "." * (node.level or 0) + (node.module or "")
                for a in node.names:
                    if a.name != "*":
                        self.aliases[a.asname or a.name] = f"{module}.{a.name}" if module else a.name
            elif isinstance(node, ast.ClassDef):
                self.classes[node.name] = node
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.functions.setdefault(node.name, node)  # type: ignore[arg-type]

    def line(self, lineno: int) -> str:
        return self.lines[lineno - 1].strip() if 0 < lineno <= len(self.lines) else ""

    def qualname(self, node: ast.AST) -> Optional[str]:
        """The dotted name an expression refers to, through import aliases (None if not a name)."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id, node.id)
        if isinstance(node, ast.Attribute):
            base = self.qualname(node.value)
            return f"{base}.{node.attr}" if base else None
        return None

    def ancestors(self, class_name: str, _seen: Optional[Set[str]] = None) -> List[str]:
        """Qualified names of a local class's bases, through other local classes."""
        seen = _seen if _seen is not None else set()
        if class_name in seen or class_name not in self.classes:
            return []
        seen.add(class_name)
        out: List[str] = []
        for base in self.classes[class_name].bases:
            q = self.qualname(base)
            if q is None:
                continue
            out.append(q)
            if isinstance(base, ast.Name) and base.id in self.classes:
                out.extend(self.ancestors(base.id, seen))
        return out

    def calls(self) -> Iterator[ast.Call]:
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Call):
                yield node


def dotted(node: ast.AST) -> Optional[str]:
    """``a.b.c`` for a Name/Attribute chain, without alias resolution (None otherwise)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def framework_of(qualname: str) -> Optional[str]:
    """The framework a qualified symbol belongs to, or None."""
    parts = qualname.split(".")
    root, last = parts[0], parts[-1]
    if root in ("llamafactory", "llmtuner") or (qualname.startswith(".") and last in _LLAMAFACTORY_TRAINERS):
        return "llamafactory"  # relative: a workflow file inside LLaMA-Factory's own source tree
    if root == "transformers" and last in ("Seq2SeqTrainer", "Seq2SeqTrainingArguments"):
        return "seq2seq_trainer"
    if root == "transformers" and last in ("Trainer", "TrainingArguments"):
        return "hf_trainer"
    if root == "trl" and (last.endswith("Trainer") or last.endswith("Config")):
        return "hf_trainer"  # trl's trainers subclass transformers.Trainer
    if root in _LIGHTNING_ROOTS and last in _LIGHTNING_NAMES:
        return "lightning"
    if root == "accelerate" and last == "Accelerator":
        return "accelerate"
    if root == "torch" and (last in _DDP_NAMES or qualname == "torch.distributed"
                            or qualname.startswith("torch.distributed.")):
        return "ddp"
    if root == "odb" and len(parts) > 2 and parts[1] == "integrations" and parts[2] in _ODB_INTEGRATIONS:
        return _ODB_INTEGRATIONS[parts[2]]  # odb's own hook names the framework it hooks into
    if root == "odb" and last == "ShardSampler":
        return "ddp"
    if root == "deepspeed" and last == "initialize":
        return "ddp"
    return None


def _framework_of_module(module: str) -> Optional[str]:
    root = module.split(".")[0]
    if root in _LIGHTNING_ROOTS:
        return "lightning"
    if root == "accelerate":
        return "accelerate"
    return None


def odb_symbols(index: ScriptIndex) -> List[str]:
    """``L<line> <qualified name>`` for every odb symbol the script calls or subclasses."""
    found = []
    for node in ast.walk(index.tree):
        target = node.func if isinstance(node, ast.Call) else None
        targets = [target] if target is not None else (node.bases if isinstance(node, ast.ClassDef) else [])
        for t in targets:
            q = index.qualname(t)
            if q and q.split(".")[0] == "odb":
                found.append(f"L{node.lineno} {q}")
    return sorted(set(found), key=lambda s: int(s.split()[0][1:]))


def _evidence(index: ScriptIndex) -> List[Evidence]:
    ev: List[Evidence] = []
    for imp in index.imports:
        modules = [a.name for a in imp.names] if isinstance(imp, ast.Import) else [
            f"{imp.module or ''}.{a.name}" for a in imp.names]
        for mod in modules:
            fw = framework_of(mod) or _framework_of_module(mod)
            if fw:
                ev.append(Evidence(fw, imp.lineno, index.line(imp.lineno), f"imports {mod}", False))
    for cls in index.classes.values():
        for q in index.ancestors(cls.name):
            fw = framework_of(q)
            if fw:
                ev.append(Evidence(fw, cls.lineno, index.line(cls.lineno), f"class {cls.name} subclasses {q}", True))
    for call in index.calls():
        q = index.qualname(call.func)
        fw = framework_of(q) if q else None
        if fw is None and isinstance(call.func, ast.Name) and call.func.id in index.classes:
            fw = next((framework_of(a) for a in index.ancestors(call.func.id) if framework_of(a)), None)
            q = f"{call.func.id} (a local subclass)"
        if fw:
            ev.append(Evidence(fw, call.lineno, index.line(call.lineno), f"calls {q}", True))
    for node in training_loops(index):
        ev.append(Evidence("plain_loop", node.lineno, index.line(node.lineno), "loop whose body calls .backward()",
                           True))
    ev.sort(key=lambda e: (e.line, e.framework))
    return ev


LOOPS = (ast.For, ast.AsyncFor, ast.While)


def is_backward(node: ast.AST) -> bool:
    """``x.backward(...)``, ``accelerator.backward(loss)``, ``self.manual_backward(loss)``."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("backward", "manual_backward"))


def calls_backward(index: "ScriptIndex", node: ast.AST, depth: int = 3) -> bool:
    """Whether ``node`` calls backward, itself or through local functions it calls (``depth`` deep)."""
    for n in ast.walk(node):
        if is_backward(n):
            return True
        if depth and isinstance(n, ast.Call):
            name = n.func.id if isinstance(n.func, ast.Name) else (
                n.func.attr if isinstance(n.func, ast.Attribute) and dotted(n.func.value) == "self" else None)
            func = index.functions.get(name) if name else None
            if func is not None and func is not node and calls_backward(index, func, depth - 1):
                return True
    return False


def training_loops(index: "ScriptIndex") -> List[ast.AST]:
    """Innermost loops whose step calls backward (an epoch loop around a batch loop is not one)."""
    with_backward = [n for n in ast.walk(index.tree) if isinstance(n, LOOPS) and calls_backward(index, n)]
    inner = [n for n in with_backward
             if not any(m is not n and isinstance(m, LOOPS) and m in with_backward for m in ast.walk(n))]
    return sorted(inner, key=lambda n: n.lineno)


def detect_index(index: ScriptIndex) -> Detection:
    evidence = _evidence(index)
    strong = {e.framework for e in evidence if e.strong}
    weak = {e.framework for e in evidence}
    # A plain loop that sits inside an Accelerate/Lightning script is that framework's loop.
    chosen = next((fw for fw in PRIORITY if fw in strong), None) or next((fw for fw in PRIORITY if fw in weak),
                                                                          "unknown")
    frameworks = [fw for fw in PRIORITY if fw in weak]
    distributed = "ddp" in strong
    return Detection(path=index.path, framework=chosen, frameworks=frameworks, distributed=distributed,
                     entry_point=ENTRY_POINTS[chosen], reference=REFERENCES[chosen], odb_used=odb_symbols(index),
                     evidence=evidence)


def detect_source(source: str, path: str = "<script>") -> Detection:
    return detect_index(ScriptIndex(source, path))


def detect_file(path: str) -> Detection:
    with open(path, encoding="utf-8") as f:
        return detect_source(f.read(), path)


def format_text(d: Detection) -> str:
    out = [f"{d.path}: {d.framework}"]
    others = [fw for fw in d.frameworks if fw != d.framework]
    if others:
        out.append(f"  also seen: {', '.join(others)}")
    out.append(f"  distributed: {'yes' if d.distributed else 'not in this file (a launcher may still add ranks)'}")
    out.append(f"  odb entry point: {d.entry_point}")
    out.append(f"  reference: {d.reference}")
    out.append(f"  odb already used: {', '.join(d.odb_used) if d.odb_used else 'no'}")
    out.append("  evidence:")
    for e in d.evidence:
        out.append(f"    L{e.line} [{e.framework}{'' if e.strong else ', import only'}] {e.reason}: {e.code}")
    if not d.evidence:
        out.append("    (none: no known trainer, no loop calling .backward())")
    return "\n".join(out)


def load_index(path: str) -> ScriptIndex:
    """Parse a script for the CLIs; SystemExit(2) with a message when it cannot be read or parsed."""
    try:
        with open(path, encoding="utf-8") as f:
            return ScriptIndex(f.read(), path)
    except OSError as e:
        raise SystemExit(f"error: cannot read {path}: {e.strerror}") from None
    except SyntaxError as e:
        raise SystemExit(f"error: {path}:{e.lineno}: not valid Python ({e.msg}); nothing was checked") from None


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Detect the training framework of a script (static, never runs it).")
    parser.add_argument("script", help="path of the training script")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    try:
        d = detect_index(load_index(args.script))
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(d.as_dict(), indent=2) if args.json else format_text(d))
    return 0 if d.framework != "unknown" else 1


if __name__ == "__main__":
    sys.exit(main())
