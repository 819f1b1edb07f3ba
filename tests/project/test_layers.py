"""The package's layers hold: imports run down, never up and never in circles.

src/odb is a stack of layers (docs/architecture.md), bottom to top:

    plan < {config, config_rules, arguments, step_info, private_api} < comm < data < epoch < resume < {train, packed}
         < loader < integrations < bench

A module may import modules of its own layer or of lower layers. ``odb/__init__.py`` is
exempt: it re-exports the public API from every layer. What the tests check:

- ``odb.plan`` and each of its modules import without torch (planning is numpy only);
- only ``odb.comm.dist`` (the transport) imports ``torch.distributed``, in any form, anywhere in a module
  (the benchmark, ``odb.bench``, trains with DDP as a user's script does and is exempt); the exchange
  protocol (``odb.comm.protocol``) imports no torch at all;
- no import circle among odb's modules (imports inside ``if TYPE_CHECKING:`` excepted);
- no import runs up the stack;
- ``import odb`` loads no training framework.

Imports are read from the source (``ast``), at any nesting level (a function's import
runs too, only later), so these tests need no torch and run in well under a second,
except the two that start an interpreter.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "odb"

# Bottom to top; a module's layer is that of its package under odb (odb.config etc. are single modules).
LAYERS: List[Set[str]] = [
    {"plan"},
    {"config", "config_rules", "arguments", "step_info", "private_api"},
    {"comm"},
    {"data"},
    {"epoch"},
    {"resume"},
    {"train", "packed"},
    {"loader"},
    {"integrations"},
    {"bench"},
]
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}
FRAMEWORKS = ("transformers", "accelerate", "lightning", "pytorch_lightning", "trl", "llamafactory", "datasets")


class Import(NamedTuple):
    source: str  # the importing module, e.g. "odb.epoch.run"
    target: str  # the imported module (a module's attribute resolves to the module), e.g. "odb.resume.state"
    where: str  # "src/odb/epoch/run.py:23"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> Dict[str, Path]:
    """Every module of the odb package by dotted name."""
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.stmt]:
    """Every import statement at any depth, except in the body of ``if TYPE_CHECKING:`` (its else runs)."""
    stack: List[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def odb_imports() -> List[Import]:
    """Every import of an odb module by an odb module."""
    known = modules()
    found: List[Import] = []
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in _import_nodes(tree):
            where = f"{path.relative_to(SRC.parent)}:{node.lineno}"
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = _absolute(node, name, path.name == "__init__.py")
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names]
            for target in targets:
                if target == "odb" or target.startswith("odb."):
                    while target not in known and "." in target:  # a name inside a module
                        target = target.rsplit(".", 1)[0]
                    found.append(Import(name, target, where))
    return found


def layer(module: str) -> Optional[int]:
    """The layer of a module, None for a module outside every layer (and for the odb package itself)."""
    return RANK.get(module.split(".")[1]) if "." in module else None


def api_layer(imports: List[Import]) -> int:
    """The layer of ``odb`` itself (``odb/__init__.py``): the highest layer it re-exports from.

    Importing ``odb`` runs every module it re-exports, so only modules of that layer or
    above may import it (the integrations and the benchmark use the public API); one that
    ``odb`` re-exports and that imports ``odb`` back is an import circle as well.
    """
    return max(layer(i.target) or 0 for i in imports if i.source == "odb")


def layer_name(module: str) -> str:
    return "odb" if module == "odb" else module.split(".")[1]


def find_cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """One cycle (as a path that returns to its start) per strongly connected component with more than one
    module or a self-import (Tarjan's algorithm, iterative)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components: List[List[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work: List[Tuple[str, Iterator[str]]] = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in edges.get(node, ()):
                    components.append(sorted(component))
    return [_cycle_in(component, edges) for component in components]


def _cycle_in(component: List[str], edges: Dict[str, Set[str]]) -> List[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    start, members = component[0], set(component)
    previous: Dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(edges.get(node, ())):
                if child not in members or child in previous:
                    continue
                previous[child] = node
                if child == start:
                    path = [start]
                    while path[-1] != start or len(path) == 1:
                        path.append(previous[path[-1]])
                    return path[::-1]
                following.append(child)
        frontier = following
    return component  # not reached: a strongly connected component holds a cycle through each member


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(SRC.parent))


# ---- the tests -----------------------------------------------------------------------------


def test_every_module_has_a_layer():
    loose = sorted(name for name in modules() if name != "odb" and layer(name) is None)
    assert not loose, (f"modules outside every layer: {loose}. Fix: put them in a layer package, or add their "
                       f"package to LAYERS here and to docs/architecture.md")


def test_plan_imports_without_torch():
    """``odb.plan`` and each of its modules import in an interpreter where torch cannot be imported.

    Importing ``odb.plan.x`` would run ``odb/__init__.py`` (which imports torch) first, so an
    empty ``odb`` package stands in for it: the plan modules' own imports are what runs.
    """
    plan = sorted(name for name in modules() if name == "odb.plan" or name.startswith("odb.plan."))
    assert len(plan) > 1
    code = textwrap.dedent(f"""
        import importlib, importlib.abc, json, sys, traceback, types

        class NoTorch(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "torch" or name.startswith("torch."):
                    raise ImportError(f"torch is blocked here: {{name}}")
                return None

        sys.meta_path.insert(0, NoTorch())
        odb = types.ModuleType("odb")
        odb.__path__ = [{str(PACKAGE)!r}]
        odb.__package__ = "odb"
        sys.modules["odb"] = odb
        failed = {{}}
        for name in {plan!r}:
            try:
                importlib.import_module(name)
            except BaseException:
                failed[name] = traceback.format_exc(limit=-3)
        print(json.dumps({{"failed": failed, "torch": [m for m in sys.modules if m.split(".")[0] == "torch"]}}))
    """)
    result = _run(code)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert not out["failed"], "plan modules that need torch (or fail) on import:\n" + "\n".join(
        f"{name}:\n{trace}" for name, trace in out["failed"].items())
    assert out["torch"] == []


def _distributed_imports(node: ast.stmt) -> List[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name == "torch.distributed" or a.name.startswith("torch.distributed.")]
    if node.level:
        return []
    module = node.module or ""
    if module == "torch.distributed" or module.startswith("torch.distributed."):
        return [module]
    if module == "torch":
        return [f"torch.{a.name}" for a in node.names if a.name == "distributed"]
    return []


def test_only_the_transport_imports_torch_distributed():
    found = []
    for name, path in modules().items():
        if name == "odb.comm.dist":  # the gloo transport and its groups; the protocol is numpy only
            continue
        if name.startswith("odb.bench."):  # the benchmark trains with DDP as a user's script does (its own
            continue  # process group, DistributedDataParallel): a user of odb, not a layer of it
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found += [f"{path.relative_to(SRC.parent)}:{node.lineno}: {what}"
                          for what in _distributed_imports(node)]
    assert not found, ("torch.distributed is odb.comm.dist's alone (the exchange's transport); imported elsewhere:"
                       "\n  " + "\n  ".join(sorted(found)) + "\nFix: go through odb.comm.dist.")


def test_the_exchange_protocol_imports_no_torch():
    tree = ast.parse((SRC / "odb" / "comm" / "protocol.py").read_text(encoding="utf-8"))
    imported = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names] + \
        [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imported if m == "torch" or m.startswith("torch.")], imported


def test_no_import_circles():
    imports = odb_imports()
    edges: Dict[str, Set[str]] = {}
    for i in imports:
        edges.setdefault(i.source, set()).add(i.target)
    cycles = find_cycles(edges)
    where = {(i.source, i.target): i.where for i in imports}
    described = ["\n".join(f"  {a} -> {b}  ({where[(a, b)]})" for a, b in zip(cycle, cycle[1:])) for cycle in cycles]
    assert not cycles, "import circles among odb's modules:\n" + "\n\n".join(described)


def test_imports_run_down_the_layers():
    imports = odb_imports()
    api = api_layer(imports)
    up = []
    for i in sorted(set(imports), key=lambda i: (i.source, i.where, i.target)):
        if i.source == "odb":  # the package re-exports the public API from the layers
            continue
        source, target = layer(i.source), api if i.target == "odb" else layer(i.target)
        if source is not None and target is not None and target > source:
            up.append(f"{i.where}: {i.source} ({layer_name(i.source)}) imports {i.target} "
                      f"({layer_name(i.target)})")
    order = " < ".join("{" + ", ".join(sorted(names)) + "}" if len(names) > 1 else next(iter(names))
                       for names in LAYERS)
    assert not up, (f"imports that run up the layers ({order}; odb itself counts as {sorted(LAYERS[api])[0]}'s "
                    f"layer, the highest it re-exports from):\n  " + "\n  ".join(up))


def test_import_odb_loads_no_training_framework():
    result = _run(f"import json, sys, odb; print(json.dumps([m for m in {FRAMEWORKS!r} if m in sys.modules]))")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_the_scan_sees_every_kind_of_import():
    """The scanner itself: function-level and relative imports count, TYPE_CHECKING imports do not."""
    tree = ast.parse(textwrap.dedent("""
        from typing import TYPE_CHECKING
        import odb.plan.cost
        from odb.plan import planner, cost as c
        if TYPE_CHECKING:
            from odb.config import ODBConfig
        else:
            from odb.step_info import ODBStepInfo
        def f():
            import torch.distributed as dist
            from torch import distributed
            from . import window
    """))
    nodes = list(_import_nodes(tree))
    modules_seen = sorted(n.module or "." for n in nodes if isinstance(n, ast.ImportFrom))
    assert modules_seen == [".", "odb.plan", "odb.step_info", "torch", "typing"]
    assert sorted(w for n in nodes for w in _distributed_imports(n)) == ["torch.distributed", "torch.distributed"]
    relative = next(n for n in nodes if isinstance(n, ast.ImportFrom) and n.level)
    assert _absolute(relative, "odb.plan.align", False) == "odb.plan"
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
