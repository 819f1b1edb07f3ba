"""What audit_integration.py knows about a script's odb loaders, read with ``ast`` only.

``loader_sites`` finds every ``odb.ODBDataLoader(...)`` and ``odb.apply(...)`` with the
DataLoader arguments and odb options that reach it, and the names the loader is held
under (through ``handle.loader``, builder functions, ``configure_accelerator`` and
``accelerator.prepare``); ``loops_over`` finds the loops that iterate it.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Set, Tuple

from detect_framework import LOOPS, ScriptIndex, dotted

UNKNOWN = object()  # a value the script computes at run time
LLAMAFACTORY_ENABLE = "integrations.llamafactory.enable_odb"


def odb_name(index: ScriptIndex, func: ast.AST) -> Optional[str]:
    """``ODBDataLoader``, ``apply``, ``integrations.hf.enable_odb``... for an odb symbol, else None."""
    q = index.qualname(func)
    if not q or q.split(".")[0] != "odb":
        return None
    parts = q.split(".")[1:]
    if parts and parts[0] == "integrations":
        return ".".join(parts)
    return parts[-1] if parts else None


def literal(index: ScriptIndex, node: Optional[ast.AST]) -> Any:
    """The constant value of an expression, through one unambiguous ``NAME = constant``; else UNKNOWN."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = literal(index, node.operand)
        return -v if isinstance(v, (int, float)) else UNKNOWN
    if isinstance(node, ast.Name):
        values = assigned_values(index, node.id)
        if len(values) == 1 and not isinstance(values[0], ast.Name):
            return literal(index, values[0])
    return UNKNOWN


def assigned_values(index: ScriptIndex, name: str) -> List[ast.AST]:
    """Every expression assigned to a dotted name (``x = ...``, ``self.x = ...``) anywhere in the script."""
    out = []
    for node in ast.walk(index.tree):
        if isinstance(node, ast.Assign):
            if any(dotted(t) == name for t in node.targets):
                out.append(node.value)
        elif isinstance(node, ast.AnnAssign) and node.value is not None and dotted(node.target) == name:
            out.append(node.value)
    return out


def resolve_call(index: ScriptIndex, node: Optional[ast.AST]) -> Optional[ast.Call]:
    """The call an expression comes from: itself, or the one call assigned to its name."""
    if isinstance(node, ast.Call):
        return node
    name = dotted(node) if node is not None else None
    if name:
        calls = [v for v in assigned_values(index, name) if isinstance(v, ast.Call)]
        if len(calls) == 1:
            return calls[0]
    return None


def call_args(call: ast.Call, positional: Tuple[str, ...]) -> Tuple[Dict[str, ast.AST], bool]:
    """Arguments by name (positional ones named by ``positional``) and whether ``*a``/``**kw`` hide some."""
    args: Dict[str, ast.AST] = {}
    is_open = False
    for i, a in enumerate(call.args):
        if isinstance(a, ast.Starred):
            is_open = True
        elif i < len(positional):
            args[positional[i]] = a
    for kw in call.keywords:
        if kw.arg is None:
            is_open = True
        else:
            args[kw.arg] = kw.value
    return args, is_open


@dataclass
class LoaderSite:
    call: ast.Call                     # odb.ODBDataLoader(...) or odb.apply(...)
    kind: str                          # "ODBDataLoader" or "apply" (in place: also LLaMA-Factory's loader mode)
    names: Set[str]                    # dotted names that hold the odb loader
    options: Dict[str, ast.AST]        # odb options, including those of config=ODBConfig(...)
    options_open: bool                 # some options are hidden (**kwargs, a config built elsewhere)
    loader_args: Optional[Dict[str, ast.AST]]  # DataLoader arguments (None: the loader was built elsewhere)
    loader_open: bool
    loader_line: int
    label: str = ""                    # how messages name the entry point
    target: Optional[ast.AST] = None   # odb.apply's loader argument

    @property
    def line(self) -> int:
        return self.call.lineno


_DL_POSITIONAL = ("dataset", "batch_size", "shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn")


def loader_sites(index: ScriptIndex) -> List[LoaderSite]:
    sites = []
    for call in index.calls():
        label = odb_name(index, call.func)
        if label == "ODBDataLoader":
            args, is_open = call_args(call, ("dataset", "token_budget"))
        elif label == "apply":
            args, is_open = call_args(call, ("loader", "token_budget"))
        elif label == LLAMAFACTORY_ENABLE:
            args, is_open = call_args(call, ("trainer", "loader", "training_args", "token_budget"))
            if "loader" not in args and "train_dataloader" not in args:
                continue  # trainer mode: the Trainer builds the loader
            args["loader"] = args.pop("train_dataloader", args.get("loader"))
            if "training_args" in args:  # it supplies gradient_accumulation_steps
                args.setdefault("gradient_accumulation_steps", args["training_args"])
        else:
            continue
        kind = "ODBDataLoader" if label == "ODBDataLoader" else "apply"
        options = {k: v for k, v in args.items() if k not in _DL_POSITIONAL + ("trainer", "loader", "training_args")}
        if "config" in args:
            cfg = resolve_call(index, args["config"])
            if cfg is not None and odb_name(index, cfg.func) == "ODBConfig":
                cfg_args, cfg_open = call_args(cfg, ("token_budget",))
                options = {**cfg_args, **options}
                is_open = is_open or cfg_open
            else:
                is_open = True
        names = _holders(index, call)
        if kind == "apply":
            names |= {f"{n}.loader" for n in names}  # the handle's loader
        if kind == "ODBDataLoader":
            loader_args, loader_open, loader_line = args, is_open, call.lineno
        else:
            loader_args, loader_open, loader_line = None, True, call.lineno
            target = args.get("loader")
            if target is not None and dotted(target):
                names.add(dotted(target))
            dl = resolve_call(index, target)
            if dl is not None and (index.qualname(dl.func) or "").endswith("DataLoader"):
                loader_args, loader_open = call_args(dl, _DL_POSITIONAL)
                loader_line = dl.lineno
        names = _follow(index, names)
        sites.append(LoaderSite(call, kind, names, options, is_open, loader_args, loader_open, loader_line,
                                f"odb.{label}", args.get("loader")))
    return sites


WRAPPERS = {"configure_accelerator", "prepare", "skip_first_batches"}  # calls that hand the loader back


def _follow(index: ScriptIndex, names: Set[str]) -> Set[str]:
    """Add the names a loader gets through wrappers: ``configure_accelerator``, ``accelerator.prepare``."""
    names = set(names)
    changed = True
    while changed:
        changed = False
        for node in ast.walk(index.tree):
            if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                    and callee_name(node.value.func) in WRAPPERS):
                continue
            args = node.value.args
            positions = [i for i, a in enumerate(args) if dotted(a) in names]
            for t in node.targets if positions else []:
                if isinstance(t, ast.Tuple) and len(t.elts) == len(args):
                    new = {dotted(t.elts[i]) for i in positions}
                else:
                    new = {dotted(t)}
                new.discard(None)
                if not new <= names:
                    names |= new  # type: ignore[arg-type]
                    changed = True
    return names


def _holders(index: ScriptIndex, call: ast.Call) -> Set[str]:
    """Names the call's result is stored under, through ``handle.loader`` and local builder functions."""
    names: Set[str] = set()
    parent = index.parents.get(call)
    while isinstance(parent, ast.Call) and callee_name(parent.func) in WRAPPERS:
        call, parent = parent, index.parents.get(parent)  # configure_accelerator(acc, odb.ODBDataLoader(...))
    if isinstance(parent, (ast.Assign, ast.AnnAssign)):
        targets = parent.targets if isinstance(parent, ast.Assign) else [parent.target]
        for t in targets:
            if dotted(t):
                names.add(dotted(t))
    if isinstance(parent, ast.Return) or (names and _returned(index, names)):
        func = enclosing_function(index, call)
        if func is not None:
            for other in index.calls():
                if isinstance(other.func, (ast.Name, ast.Attribute)) and callee_name(other.func) == func.name:
                    holder = index.parents.get(other)
                    if isinstance(holder, ast.Assign):
                        names.update(dotted(t) for t in holder.targets if dotted(t))
    return names


def _returned(index: ScriptIndex, names: Set[str]) -> bool:
    return any(isinstance(n, ast.Return) and n.value is not None and dotted(n.value) in names
               for n in ast.walk(index.tree))


def callee_name(func: ast.AST) -> Optional[str]:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def enclosing_function(index: ScriptIndex, node: ast.AST) -> Optional[ast.FunctionDef]:
    while node in index.parents:
        node = index.parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return node  # type: ignore[return-value]
    return None


def loops_over(index: ScriptIndex, names: Set[str]) -> List[ast.AST]:
    """For-loops whose iterable mentions one of ``names`` (``loader``, ``enumerate(tqdm(loader))``)."""
    out = []
    for node in ast.walk(index.tree):
        if isinstance(node, (ast.For, ast.AsyncFor)):
            if any(dotted(n) in names for n in ast.walk(node.iter) if isinstance(n, (ast.Name, ast.Attribute))):
                out.append(node)
    return sorted(out, key=lambda n: n.lineno)


def batch_target(loop: ast.AST) -> Tuple[Optional[str], Optional[ast.AST]]:
    """(batch variable, None) or (None, the unpacking target) of ``for ... in loader``."""
    target = loop.target  # type: ignore[attr-defined]
    it = loop.iter  # type: ignore[attr-defined]
    if (isinstance(it, ast.Call) and isinstance(it.func, ast.Name) and it.func.id == "enumerate"
            and isinstance(target, ast.Tuple) and len(target.elts) == 2):
        target = target.elts[1]
    return (target.id, None) if isinstance(target, ast.Name) else (None, target)


def enclosing_loop(index: ScriptIndex, node: ast.AST) -> Optional[ast.AST]:
    while node in index.parents:
        node = index.parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return None
        if isinstance(node, LOOPS):
            return node
    return None
