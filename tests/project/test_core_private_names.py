"""odb.private_api's CORE_NAMES: each private name odb's core reads exists, with its type, on the installed torch
and transformers (a real object of each), and ``read`` refuses a missing or retyped one with the fix."""

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from odb.private_api import CORE_NAMES, TESTED, FrameworkDrift, read, version_of


def _checkpoint_node():
    layer = torch.nn.Linear(2, 2)
    out = checkpoint(layer, torch.ones(1, 2, requires_grad=True), use_reentrant=True)
    return out.grad_fn, None


def _tensor():
    return torch.zeros(2), None


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(), None


def _rebalance_sampler():
    trainer_pt_utils = pytest.importorskip("transformers.trainer_pt_utils")
    if not hasattr(trainer_pt_utils, "BatchRebalanceSampler"):
        pytest.skip("this transformers has no BatchRebalanceSampler (the benchmark that wraps it runs on the pins)")
    return trainer_pt_utils.BatchRebalanceSampler([3, 5, 2, 7], effective_batch_size=2, dp_size=1, grad_accum=1,
                                                  rank=0), None


OBJECTS = {("autograd node of a custom Function", "_forward_cls"): _checkpoint_node,
           ("CheckpointFunction's node", "run_function"): _checkpoint_node,
           ("Tensor", "_version"): _tensor,
           ("PretrainedConfig", "_attn_implementation"): _config,
           ("BatchRebalanceSampler", "_assign"): _rebalance_sampler}


def test_every_core_name_has_a_real_object_here():
    assert sorted(OBJECTS) == sorted((n.owner, n.name) for n in CORE_NAMES)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("entry", CORE_NAMES, ids=lambda n: f"{n.owner}.{n.name}")
def test_each_core_name_reads_on_the_installed_versions(entry):
    obj, cleanup = OBJECTS[(entry.owner, entry.name)]()
    try:
        value = read(obj, entry.owner, entry.name)
    finally:
        if cleanup is not None:
            cleanup()
    assert callable(value) if entry.kind == "method" else isinstance(value, entry.types)


@pytest.mark.parametrize("entry", CORE_NAMES, ids=lambda n: f"{n.owner}.{n.name}")
def test_a_missing_core_name_is_refused_naming_the_version_and_the_fix(entry):
    with pytest.raises(FrameworkDrift) as refused:
        read(object(), entry.owner, entry.name)
    text = str(refused.value)
    assert f"{entry.owner}.{entry.name}" in text and f"the installed {entry.framework} {version_of(entry.framework)}" \
        in text, text
    assert f"Fix: pin the tested range (pip install '{TESTED[entry.framework]}')" in text, text


def test_a_core_name_of_another_type_is_refused():
    class Tensor:
        _version = "3"  # a str where torch keeps an int

    with pytest.raises(FrameworkDrift, match=r"_version of type str, not int"):
        read(Tensor(), "Tensor", "_version")


def test_no_module_reads_a_private_name_with_a_default():
    """``getattr(obj, "_name", default)`` hides a renamed private name behind the default: odb reads another
    library's private names through ``odb.private_api.read`` (odb's own ``_odb`` markers on foreign objects excepted)."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "src" / "odb"
    found = []
    for path in sorted(src.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                name = node.args[1].value
                if name.startswith("_") and not name.startswith("__") and not name.startswith("_odb"):
                    found.append(f"{path.relative_to(src.parent)}:{node.lineno}: getattr(..., {name!r}, ...)")
    assert not found, "private names read with a default:\n" + "\n".join(found)
