"""What one training step does, read with ``ast`` only: the walk behind audit_integration.py's loop rules.

``scan_step`` walks a loop body in evaluation order, descending into local helper
functions, and records when the step info is popped, when the batch is used whole,
where the loss is scaled, backward and optimizer steps, and branches that skip ghosts.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from typing import List, Optional, Set, Tuple

from detect_framework import ScriptIndex, calls_backward, dotted, is_backward

from .loaders import batch_target, callee_name, odb_name

HARMLESS_CALLS = {"len", "isinstance", "type", "id", "print", "hasattr", "getattr", "repr", "str"}
HARMLESS_METHODS = {"pop", "get", "keys"}
CONVERSIONS = {"float", "int", "round", "bool", "abs", "max", "min", "tensor", "as_tensor", "item"}
LOG_CALLS = {"print", "log", "info", "debug", "warning", "write", "set_postfix", "add_scalar", "log_dict", "format"}
TRY_NODES = (ast.Try,) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())  # except* (3.11)
NOT_SCALING = LOG_CALLS | CONVERSIONS | HARMLESS_CALLS  # a loss_scale passed to these scales nothing


@dataclass
class Step:
    """What one training step does, in evaluation order."""
    pops: List[ast.AST] = field(default_factory=list)
    early_uses: List[ast.Call] = field(default_factory=list)  # the whole batch used before the pop
    scaled: List[ast.AST] = field(default_factory=list)
    divided: List[ast.AST] = field(default_factory=list)
    backwards: List[ast.Call] = field(default_factory=list)
    optimizer_steps: List[Tuple[ast.Call, List[ast.AST]]] = field(default_factory=list)  # (call, enclosing tests)
    ghost_skips: List[ast.If] = field(default_factory=list)
    accumulate_blocks: List[ast.AST] = field(default_factory=list)  # with accelerator.accumulate(...)


def is_pop(index: ScriptIndex, call: ast.Call) -> bool:
    if odb_name(index, call.func) == "pop_step_info":
        return True
    return (isinstance(call.func, ast.Attribute) and call.func.attr == "pop" and bool(call.args)
            and isinstance(call.args[0], ast.Constant) and call.args[0].value == "odb_step_info")


def mentions(node: ast.AST, attrs: Tuple[str, ...]) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in attrs for n in ast.walk(node))


def is_ghost_test(test: ast.AST) -> bool:
    if mentions(test, ("is_ghost",)):
        return True
    for n in ast.walk(test):  # `not info.local_samples`, `info.local_samples == 0`
        if isinstance(n, ast.UnaryOp) and isinstance(n.op, ast.Not) and mentions(n.operand, ("local_samples",)):
            return True
        if (isinstance(n, ast.Compare) and mentions(n, ("local_samples",))
                and any(isinstance(c, ast.Constant) and c.value == 0 for c in n.comparators)):
            return True
    return False


def is_optimizer_step(call: ast.Call) -> bool:
    if not (isinstance(call.func, ast.Attribute) and call.func.attr == "step"):
        return False
    owner = (dotted(call.func.value) or "").lower()
    return "opt" in owner or (owner.endswith("scaler") and bool(call.args))


class StepScanner:
    """Walks a loop body in evaluation order, following local helper functions one call deep at a time."""

    def __init__(self, index: ScriptIndex, batch: Optional[str], max_depth: int = 3) -> None:
        self.index = index
        self.batch: Set[str] = {batch} if batch else set()
        self.scale_names: Set[str] = set()
        self.step = Step()
        self.tests: List[ast.AST] = []
        self.active: Set[str] = set()
        self.max_depth = max_depth
        self.quiet = 0  # inside logging (print, f-strings): arithmetic there does not reach backward

    @property
    def popped(self) -> bool:
        return bool(self.step.pops)

    # ---- statements ------------------------------------------------------------------
    def body(self, stmts: List[ast.stmt]) -> None:
        for s in stmts:
            self.stmt(s)

    def stmt(self, s: ast.stmt) -> None:
        if isinstance(s, ast.If):
            if is_ghost_test(s.test) and _skips_work(self.index, s):
                self.step.ghost_skips.append(s)
            self.expr(s.test)
            self.tests.append(s.test)
            self.body(s.body)
            self.body(s.orelse)
            self.tests.pop()
        elif isinstance(s, (ast.Assign, ast.AnnAssign)):
            self.expr(s.value)
            targets = s.targets if isinstance(s, ast.Assign) else [s.target]
            if s.value is not None and _is_scale_source(s.value):
                self.scale_names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(s, ast.AugAssign):
            self.expr(s.value)
            if isinstance(s.op, ast.Mult) and self.has_scale(s.value):
                self.step.scaled.append(s)
            if isinstance(s.op, ast.Div) and self.has_scale(s.value):
                self.step.divided.append(s)
        elif isinstance(s, (ast.For, ast.AsyncFor, ast.While)):
            self.expr(s.iter if not isinstance(s, ast.While) else s.test)
            self.body(s.body)
            self.body(s.orelse)
        elif isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                ctx = item.context_expr
                if (isinstance(ctx, ast.Call) and isinstance(ctx.func, ast.Attribute)
                        and ctx.func.attr == "accumulate"):
                    self.step.accumulate_blocks.append(s)
                self.expr(ctx)
            self.body(s.body)
        elif isinstance(s, TRY_NODES):
            self.body(s.body)
            for h in s.handlers:
                self.body(h.body)
            self.body(s.orelse)
            self.body(s.finalbody)
        elif isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return
        else:
            for child in ast.iter_child_nodes(s):
                if isinstance(child, ast.expr):
                    self.expr(child)

    # ---- expressions -------------------------------------------------------------------
    def expr(self, node: Optional[ast.AST]) -> None:
        if node is None:
            return
        if isinstance(node, ast.Call):
            self.call(node)
            return
        if isinstance(node, ast.BinOp):
            self.expr(node.left)
            self.expr(node.right)
            if self.quiet:
                return
            if isinstance(node.op, ast.Mult) and (self.has_scale(node.left) or self.has_scale(node.right)):
                self.step.scaled.append(node)
            if isinstance(node.op, ast.Div) and self.has_scale(node.right):
                self.step.divided.append(node)
            return
        if isinstance(node, ast.JoinedStr):
            self.quiet += 1
            for child in ast.iter_child_nodes(node):
                self.expr(child)
            self.quiet -= 1
            return
        if isinstance(node, (ast.Lambda,)):
            return
        for child in ast.iter_child_nodes(node):
            self.expr(child)

    def call(self, call: ast.Call) -> None:
        if is_pop(self.index, call):
            self.step.pops.append(call)
            return
        name = callee_name(call.func)
        self.expr(call.func)
        logging = name in LOG_CALLS
        self.quiet += logging
        for a in call.args:
            self.expr(a)
        for kw in call.keywords:
            self.expr(kw.value)
        self.quiet -= logging
        if is_backward(call):
            self.step.backwards.append(call)
        if is_optimizer_step(call):
            self.step.optimizer_steps.append((call, [t for t in self.tests if not is_ghost_test(t)]))
        args = list(call.args) + [kw.value for kw in call.keywords]
        odb_call = odb_name(self.index, call.func) or ""
        if odb_call == "scale_loss" or odb_call.endswith(".scale_loss"):
            self.step.scaled.append(call)  # odb.scale_loss(loss, info), integrations.accelerate.scale_loss(...)
        elif not self.quiet and name not in NOT_SCALING and any(self.has_scale(a) for a in args):
            self.step.scaled.append(call)  # loss.mul(info.loss_scale), scale_loss(loss, info.loss_scale)
        helper = self.helper(call)
        if helper is not None:
            self.descend(helper, call)
        elif not self.popped and self.passes_batch(call):
            self.step.early_uses.append(call)

    def passes_batch(self, call: ast.Call) -> bool:
        if isinstance(call.func, ast.Name) and call.func.id in HARMLESS_CALLS:
            return False
        if (isinstance(call.func, ast.Attribute) and dotted(call.func.value) in self.batch
                and call.func.attr not in HARMLESS_METHODS):
            return True  # batch.to(device), batch.items()
        values = [a.value if isinstance(a, ast.Starred) else a for a in call.args]
        values += [kw.value for kw in call.keywords]
        return any(dotted(v) in self.batch for v in values)

    def has_scale(self, node: ast.AST) -> bool:
        return any((isinstance(n, ast.Attribute) and n.attr == "loss_scale")
                   or (isinstance(n, ast.Name) and n.id in self.scale_names) for n in ast.walk(node))

    # ---- local helpers -------------------------------------------------------------------
    def helper(self, call: ast.Call) -> Optional[ast.FunctionDef]:
        name = callee_name(call.func)
        if isinstance(call.func, ast.Attribute) and dotted(call.func.value) != "self":
            return None
        func = self.index.functions.get(name) if name else None
        if func is None or name in self.active or len(self.active) >= self.max_depth:
            return None
        return func  # type: ignore[return-value]

    def descend(self, func: ast.FunctionDef, call: ast.Call) -> None:
        params = [a.arg for a in func.args.posonlyargs + func.args.args]
        if isinstance(call.func, ast.Attribute) and params[:1] == ["self"]:
            params = params[1:]
        inner: Set[str] = set()
        for i, a in enumerate(call.args):
            if dotted(a) in self.batch and i < len(params):
                inner.add(params[i])
        for kw in call.keywords:
            if kw.arg and dotted(kw.value) in self.batch:
                inner.add(kw.arg)
        saved, saved_tests = self.batch, self.tests
        self.batch, self.tests = inner, list(self.tests)
        self.active.add(func.name)
        self.body(func.body)
        self.active.discard(func.name)
        self.batch, self.tests = saved, saved_tests


def _is_scale_source(value: ast.AST) -> bool:
    """``info.loss_scale``, ``float(info.loss_scale)``, ``torch.tensor(info.loss_scale, ...)``."""
    if isinstance(value, ast.Call) and callee_name(value.func) in CONVERSIONS and value.args:
        value = value.args[0]
    return isinstance(value, ast.Attribute) and value.attr == "loss_scale"


def _skips_work(index: ScriptIndex, node: ast.If) -> bool:
    """An ``if`` on is_ghost that jumps out of the step or holds backward or the optimizer step
    (directly or through local helper functions)."""
    def walk(stmts: List[ast.stmt]) -> bool:
        for s in stmts:
            if isinstance(s, (ast.Continue, ast.Break, ast.Return)):
                return True
            if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if calls_backward(index, s) or any(isinstance(n, ast.Call) and is_optimizer_step(n) for n in ast.walk(s)):
                return True
            if isinstance(s, ast.If) and walk(s.body + s.orelse):
                return True
        return False
    return walk(node.body) or walk(node.orelse)


def scan_step(index: ScriptIndex, loop: ast.AST) -> Step:
    batch, _ = batch_target(loop)
    scanner = StepScanner(index, batch)
    scanner.body(loop.body)  # type: ignore[attr-defined]
    return scanner.step


def scan_function(index: ScriptIndex, func: ast.AST, batch: Optional[str]) -> Step:
    """The step of a function that receives a batch (Lightning's training_step)."""
    scanner = StepScanner(index, batch)
    scanner.active.add(getattr(func, "name", ""))
    scanner.body(func.body)  # type: ignore[attr-defined]
    return scanner.step
