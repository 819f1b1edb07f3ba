"""The loss of one odb micro-batch: scaled exactly, and an exact zero where there is nothing to learn.

A micro-batch whose samples hold no supervised token (answers cut away by truncation end
up together, because odb groups samples by length) makes a model's mean loss 0 / 0 = NaN.
``NaN * info.loss_scale`` stays NaN whatever the scale, so the logged loss turns NaN; and
a loss written as ``sum / count`` backpropagates ``0 / 0`` into NaN gradients, which DDP
all-reduces into every rank's model. ``scale_loss`` returns an exact zero for such a
batch instead (and for a ghost batch), still connected to the parameters the loss
depends on: backward runs as for any batch and gives each of them a zero gradient, so
DDP's gradient all-reduce stays aligned across ranks.

Example:
    >>> import torch, odb
    >>> w = torch.ones(2, requires_grad=True)
    >>> mean = (w * 0).sum() / torch.tensor(0.0)          # no supervised token: 0 / 0
    >>> info = odb.ODBStepInfo(0, 0, 1, 2, 0, 6, 4, 4, 0.0, False)
    >>> loss = odb.scale_loss(mean, info)
    >>> loss.backward(); float(loss), w.grad.tolist()
    (0.0, [0.0, 0.0])
"""

from __future__ import annotations

import functools
import sys
import warnings
from collections.abc import Mapping
from typing import Any, List, Optional, Set

import torch
from torch.autograd.function import BackwardCFunction
from torch.utils.checkpoint import CheckpointFunction

from odb.private_api import read
from odb.step_info import ODBStepInfo

_FUNCTION_NODE = "autograd node of a custom Function"  # the owner of the name read (odb.private_api.CORE_NAMES)

__all__ = ["scale_loss", "weigh_loss", "zero_loss"]


def scale_loss(loss: torch.Tensor, info: ODBStepInfo, factor: float = 1.0) -> torch.Tensor:
    """``loss * info.loss_scale * factor``, or an exact zero with a graph when the batch adds nothing.

    ``loss`` is the model's mean over this micro-batch's supervised tokens (what
    ``model(**batch).loss`` returns). The zero is returned when the batch holds no
    supervised token (``info.local_loss_tokens == 0``: the mean is 0 / 0) or its scale is 0
    (a ghost batch); see ``zero_loss``. ``factor`` undoes a division the trainer applies
    afterwards (Accelerate and Lightning divide by the accumulation steps).

    Example:
        >>> import torch, odb
        >>> info = odb.ODBStepInfo(0, 0, 2, 4, 10, 40, 12, 16, 0.5, False)
        >>> float(odb.scale_loss(torch.tensor(2.0), info))
        1.0
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"scale_loss got loss of type {type(loss).__name__}: it scales the tensor the model returns. "
                        f"Fix: pass model(**batch).loss (a tensor), not loss.item().")
    if not isinstance(info, ODBStepInfo):
        raise TypeError(f"scale_loss got info of type {type(info).__name__}, not an ODBStepInfo. Fix: pass "
                        f"info = odb.pop_step_info(batch).")
    return weigh_loss(loss, info, factor)


def weigh_loss(loss: torch.Tensor, info: ODBStepInfo, factor: float = 1.0, outputs: Any = None) -> torch.Tensor:
    """The formula behind every odb loss scaling (``scale_loss``, the integrations' ``scale_loss``, the HF
    Trainer's ``compute_loss``), without ``scale_loss``'s argument checks.

    ``zero_loss(loss, outputs)`` when the batch adds nothing (no supervised token, or a
    scale of 0: a ghost), else ``loss * (info.loss_scale * factor)``.

    Example:
        >>> import torch, odb
        >>> info = odb.ODBStepInfo(0, 0, 2, 4, 10, 40, 12, 16, 0.5, False)
        >>> float(weigh_loss(torch.tensor(2.0), info, 2.0))
        2.0
    """
    if info.local_loss_tokens == 0 or info.loss_scale == 0:
        return zero_loss(loss, outputs)
    return loss * (info.loss_scale * factor)


def zero_loss(loss: torch.Tensor, outputs: Optional[Any] = None) -> torch.Tensor:
    """A tensor of ``loss``'s shape and dtype, exactly 0, whose backward gives a zero gradient to every
    leaf tensor (parameter) that ``loss`` depends on, even when ``loss`` itself is NaN.

    ``outputs``: the model's outputs (a mapping, as transformers' ``ModelOutput``), when at
    hand. If they hold ``logits`` that require grad, the zero comes from those (an empty
    slice of them, summed: exactly 0 even for infinite logits), so every parameter that
    produced them gets a (zero) gradient, which keeps DDP's gradient all-reduce aligned.
    Otherwise, as follows, from ``loss``'s own graph.

    A finite ``loss`` (a ghost batch: a real sample) backpropagates ``loss * 0`` through its
    own graph, so backward reaches exactly the parameters a real batch reaches, those inside
    gradient checkpoints of either kind included, and each gets an exact zero (0 times a
    finite local derivative; a graph whose derivatives are inf would make a real batch's
    gradient inf or NaN too). Checking finiteness reads the loss's value (one device sync, on
    these batches only).

    A NaN or infinite ``loss`` (the mean over no supervised token, ``0 / 0``) is never
    backpropagated through, where the ``0 / 0`` would turn any gradient into NaN: the zero is
    built from the leaves of its graph directly (an empty slice of each, summed). A
    reentrant gradient checkpoint (``use_reentrant=True``) hides the parameters it runs
    until backward recomputes it; they are found from the checkpointed function instead
    (a module, a method or ``functools.partial`` of one, or a closure over one or over a
    weight, as HF's layers and ``checkpoint(self.block, x)`` pass it). Where a checkpointed
    function holds none, a warning says that its parameters get no gradient from this batch.

    Example:
        >>> import torch
        >>> w = torch.ones(3, requires_grad=True)
        >>> zero = zero_loss(w.sum() / torch.tensor(0.0))
        >>> zero.backward(); float(zero), w.grad.tolist()
        (0.0, [0.0, 0.0, 0.0])
    """
    logits = outputs.get("logits") if isinstance(outputs, Mapping) else None
    if isinstance(logits, torch.Tensor) and logits.requires_grad:
        return torch.zeros_like(loss.detach()) + logits.reshape(-1)[:0].sum().to(loss.dtype)
    base = torch.zeros_like(loss.detach())
    if not loss.requires_grad:
        return base
    if bool(torch.isfinite(loss.detach()).all()):
        return base + loss * 0
    leaves = [loss] if loss.grad_fn is None else _graph_leaves(loss.grad_fn)
    if not leaves:
        return base
    zero = sum(leaf.reshape(-1)[:0].sum().to(loss.dtype) for leaf in leaves)
    return base + zero


def _graph_leaves(root: torch.autograd.graph.Node) -> List[torch.Tensor]:
    """The leaf tensors (gradient accumulators) reachable from ``root``, each once, and the trainable
    parameters of the modules that reentrant gradient checkpoints in the graph run."""
    leaves: List[torch.Tensor] = []
    seen_leaves: Set[int] = set()

    def add(leaf: torch.Tensor) -> None:
        if id(leaf) not in seen_leaves:
            seen_leaves.add(id(leaf))
            leaves.append(leaf)

    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node holds its leaf tensor
        if isinstance(variable, torch.Tensor):
            add(variable)
        if isinstance(node, BackwardCFunction) and read(node, _FUNCTION_NODE, "_forward_cls") is CheckpointFunction:
            # a reentrant checkpoint: runs its graph in backward
            for param in _checkpointed_parameters(read(node, "CheckpointFunction's node", "run_function")):
                add(param)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return leaves


def _checkpointed_parameters(function: Any) -> List[torch.Tensor]:
    """The trainable parameters of the modules (and the trainable leaf tensors) that a reentrantly checkpointed
    ``function`` holds: itself, a bound method's owner, a ``functools.partial``'s function and arguments, a
    closure's cells, a function's default arguments, three levels deep. Warns if it holds none."""
    modules: List[torch.nn.Module] = []
    tensors: List[torch.Tensor] = []
    pending, seen = [(function, 0)], set()
    while pending:
        obj, depth = pending.pop()
        if id(obj) in seen or depth > 3:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            modules.append(obj)
            continue
        if isinstance(obj, torch.Tensor):
            if obj.is_leaf and obj.requires_grad:  # a weight held directly (a closure over it, a partial's argument)
                tensors.append(obj)
            continue
        inner: List[Any] = [getattr(obj, "__self__", None)]  # a bound method's module
        if isinstance(obj, functools.partial):
            inner += [obj.func, *obj.args, *obj.keywords.values()]
        for cell in getattr(obj, "__closure__", None) or ():  # a closure over a module
            try:
                inner.append(cell.cell_contents)
            except ValueError:  # an empty cell
                pass
        inner += list(getattr(obj, "__defaults__", None) or ())  # lambda h, w=weight: ...
        inner += list((getattr(obj, "__kwdefaults__", None) or {}).values())
        pending += [(o, depth + 1) for o in inner if o is not None]
    if not modules and not tensors:
        warnings.warn(
            f"odb.scale_loss: this micro-batch's loss is NaN or infinite (no supervised token) and its graph runs "
            f"{function!r} under reentrant gradient checkpointing (use_reentrant=True), whose parameters (if it "
            f"uses any) odb cannot find, so they get no gradient from this batch; DDP without "
            f"find_unused_parameters then fails or waits at its gradient all-reduce. Fix: checkpoint with "
            f"use_reentrant=False, or pass checkpoint a module (or a bound method or functools.partial of one).",
            stacklevel=_outside_this_module())
    return tensors + [p for m in modules for p in m.parameters() if p.requires_grad]


def _outside_this_module() -> int:
    """The ``stacklevel`` of a warning raised here that points at the first caller outside this module."""
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename == __file__:
        frame, level = frame.f_back, level + 1
    return level
