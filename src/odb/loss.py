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

from typing import List

import torch

from .step_info import ODBStepInfo

__all__ = ["scale_loss", "zero_loss"]


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
    if info.local_loss_tokens == 0 or info.loss_scale == 0:
        return zero_loss(loss)
    return loss * (info.loss_scale * factor)


def zero_loss(loss: torch.Tensor) -> torch.Tensor:
    """A tensor of ``loss``'s shape and dtype, exactly 0, whose backward gives a zero gradient to every
    leaf tensor (parameter) that ``loss`` depends on, even when ``loss`` itself is NaN.

    The zero is built from those leaves directly (an empty slice of each, summed), never
    through ``loss``'s own graph, where a ``0 / 0`` would turn any gradient into NaN. The
    parameters reached are those a backward of ``loss`` reaches, so DDP (with or without
    ``find_unused_parameters``) sees the usual set. A parameter used only inside a
    reentrant gradient checkpoint (``use_reentrant=True``) is not visible in the graph
    before backward and gets no gradient; non-reentrant checkpointing is fine.

    Example:
        >>> import torch
        >>> w = torch.ones(3, requires_grad=True)
        >>> zero = zero_loss(w.sum() / torch.tensor(0.0))
        >>> zero.backward(); float(zero), w.grad.tolist()
        (0.0, [0.0, 0.0, 0.0])
    """
    base = torch.zeros_like(loss.detach())
    if not loss.requires_grad:
        return base
    leaves = [loss] if loss.grad_fn is None else _graph_leaves(loss.grad_fn)
    if not leaves:
        return base
    zero = sum(leaf.reshape(-1)[:0].sum().to(loss.dtype) for leaf in leaves)
    return base + zero


def _graph_leaves(root: torch.autograd.graph.Node) -> List[torch.Tensor]:
    """The leaf tensors (gradient accumulators) reachable from ``root``, each once."""
    leaves: List[torch.Tensor] = []
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node holds its leaf tensor
        if isinstance(variable, torch.Tensor):
            leaves.append(variable)
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return leaves
