"""The forward pass of an RL trainer's micro-batch laid out without the gap between prompt and completion.

TRL's ``GRPOTrainer`` and ``RLOOTrainer`` score a micro-batch as one tensor of
``[prompt (left-padded) | completion (right-padded)]`` rows: every row pays the micro-batch's
longest prompt *plus* its longest completion, though a row's real tokens are contiguous.
``RolloutForward`` stands in for the trainer's ``_get_per_token_logps_and_entropies`` while
odb runs TRL's loss on a micro-batch (``swapped_in``) and runs the model on the same tokens
laid out by ``layout``:

- ``"padded"``: each row's real tokens from column 0, right-padded to the micro-batch's
  longest row (``rows x longest(prompt + completion)`` tokens, rounded up to
  ``pad_to_multiple_of``), with TRL's attention mask;
- ``"packed"``: every row's real tokens in one row, ``position_ids`` restarting at each
  rollout and no padding mask (the model must keep packed samples apart:
  ``odb.packed.models.prepare_packed_model`` checks it when odb is enabled).

It asks TRL's fused LM head (``fused_lm_head=True``, which TRL adds to the policy) for the
log-probability of each next token where TRL scores one (the completion tokens in TRL's
mask), and returns them, with the entropies, in TRL's ``(rows, completion width)`` layout:
zero where TRL's would be zero. Each rollout's tokens see the same tokens at the same
relative positions as in TRL's layout; only the absolute positions start at 0 (as they do
at generation), which a rotary (relative) position encoding does not see.

``weigh`` gives the next call its rows' weights (``odb.integrations.trl.rl_loss.RowWeights``): the
values returned are the same, but the gradient through row i's log-probabilities is scaled by its
policy weight and through its entropies by its entropy weight; with ``bonus_probe`` the entropies
are also multiplied by ``1 + q`` (``q`` zeros, a leaf the caller differentiates the loss by). Every
call is counted on a ``odb.private_api.StandIn``, so odb sees that TRL really called it.

Example:
    >>> import torch
    >>> mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])   # prompt width 2, completion width 3
    >>> lay = layout_rows(torch.arange(10).view(2, 5), mask, logits_to_keep=3, layout="padded")
    >>> lay.input_ids.tolist(), lay.shift_labels.tolist()   # row 0: prompt [1], completion [2, 3]
    ([[1, 2, 3, 0, 0], [5, 6, 7, 8, 9]], [[2, 3, -100, -100, -100], [-100, 7, 8, 9, -100]])
    >>> packed = layout_rows(torch.arange(10).view(2, 5), mask, logits_to_keep=3, layout="packed")
    >>> packed.input_ids.tolist(), packed.position_ids.tolist()
    ([[1, 2, 3, 5, 6, 7, 8, 9]], [[0, 1, 2, 0, 1, 2, 3, 4]])
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Optional, Tuple

import numpy as np
import torch

from odb.private_api import StandIn

__all__ = ["LAYOUTS", "LaidOut", "RolloutForward", "layout_rows"]

LAYOUTS = ("padded", "packed")
IGNORE = -100


class LaidOut(NamedTuple):
    """A micro-batch's tokens as the model runs them: ``input_ids`` (rows or 1, width), ``attention_mask``
    (padded) or ``position_ids`` (packed), ``shift_labels`` (the next token where TRL scores it, else -100) and
    ``source`` (rows, completion width): where in the flattened output each of TRL's positions is read."""

    input_ids: torch.Tensor
    attention_mask: Optional[torch.Tensor]
    position_ids: Optional[torch.Tensor]
    shift_labels: torch.Tensor
    source: torch.Tensor
    scored: torch.Tensor


def layout_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int, layout: str,
                pad_to_multiple_of: int = 1, pad_id: int = 0) -> LaidOut:
    """Lay out TRL's ``[prompt | completion]`` rows as ``layout`` (see the module docstring).

    Raises ``ValueError`` for a row whose real tokens are not contiguous (TRL's prompts are left-padded and its
    completions right-padded, so they always are) or whose first scored token has no token before it.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"odb got layout={layout!r} for an RL trainer's micro-batch. Rule: one of {LAYOUTS}. "
                         f"Fix: pass layout='padded' or layout='packed'.")
    mask = attention_mask.ne(0)
    rows, width = mask.shape
    keep = int(logits_to_keep)
    lengths = mask.sum(1)
    place = mask.long().cumsum(1) - 1  # each real token's place in its row once the padding is gone
    cols = torch.arange(width, device=mask.device).expand(rows, width)
    first = torch.where(mask, cols, torch.full_like(cols, width)).amin(1)
    if bool(((first + lengths != torch.where(mask, cols + 1, 0).amax(1)) & lengths.gt(0)).any()):
        raise ValueError("odb got an RL micro-batch whose real tokens are not contiguous in a row. Rule: a rollout "
                         "is a left-padded prompt followed by a right-padded completion. Fix: train this trainer "
                         "without odb's micro-batches, or report the trainer that builds such rows.")
    scored = mask[:, width - keep:]  # TRL scores the completion tokens its mask keeps
    target = place[:, width - keep:]
    if bool((scored & target.lt(1)).any()):
        raise ValueError("odb got an RL micro-batch with a scored completion token at the start of its row (no "
                         "prompt token before it). Rule: every rollout has a prompt. Fix: keep at least one prompt "
                         "token per rollout.")
    source = (target - 1).clamp(min=0)  # the logits of the token before predict it
    tokens = input_ids[mask]
    if layout == "packed":
        total = int(lengths.sum())
        start = lengths.cumsum(0) - lengths
        flat = torch.full((1, total), IGNORE, dtype=torch.long, device=mask.device)
        src = (start[:, None] + source)
        flat[0, src[scored]] = input_ids[:, width - keep:][scored]
        return LaidOut(tokens.view(1, total), None, place[mask].view(1, total), flat, src, scored)
    longest = int(lengths.max()) if rows else 0
    multiple = max(int(pad_to_multiple_of or 1), 1)
    span = max(-(-longest // multiple) * multiple, 1)
    rows_idx = torch.arange(rows, device=mask.device)[:, None].expand(rows, width)
    ids = torch.full((rows, span), int(pad_id), dtype=input_ids.dtype, device=mask.device)
    ids[rows_idx[mask], place[mask]] = tokens
    attn = (torch.arange(span, device=mask.device)[None, :] < lengths[:, None]).long()
    labels = torch.full((rows, span), IGNORE, dtype=torch.long, device=mask.device)
    scored_rows = rows_idx[:, :keep][scored]
    labels[scored_rows, source[scored]] = input_ids[:, width - keep:][scored]
    flat_source = rows_idx[:, :keep] * span + source
    return LaidOut(ids, attn, None, labels, flat_source, scored)


class RolloutForward:
    """``_get_per_token_logps_and_entropies`` of a TRL RL trainer, on the tokens laid out as ``layout``.

    ``swapped_in(trainer)`` installs it on the trainer for the duration of a ``with`` block; ``tokens`` counts
    the tokens the model ran (padding included) and ``stand_in.calls`` the forward passes.
    """

    def __init__(self, layout: str, pad_to_multiple_of: int = 1, pad_id: int = 0, owner: str = "GRPOTrainer"
                 ) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"odb got layout={layout!r} for an RL trainer. Rule: one of {LAYOUTS}. Fix: pass "
                             f"layout='padded' (default) or layout='packed'.")
        self.layout, self.pad_to_multiple_of, self.pad_id = layout, int(pad_to_multiple_of or 1), int(pad_id)
        self.tokens = 0
        self.stand_in = StandIn(owner, "_get_per_token_logps_and_entropies")
        self.trainer: Any = None
        self.weights: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self.bonus_probe: Optional[torch.Tensor] = None

    @property
    def calls(self) -> int:
        return self.stand_in.calls

    def weigh(self, policy: np.ndarray, entropy: np.ndarray, bonus_probe: Optional[torch.Tensor] = None) -> None:
        """The rows' (policy, entropy) gradient weights of the next call, and the entropy probe ``q``."""
        self.weights, self.bonus_probe = (np.asarray(policy), np.asarray(entropy)), bonus_probe

    @contextlib.contextmanager
    def swapped_in(self, trainer: Any) -> Iterator[None]:
        """``trainer._get_per_token_logps_and_entropies`` is this object's ``__call__`` inside the block."""
        self.trainer = trainer
        trainer._get_per_token_logps_and_entropies = self
        try:
            yield
        finally:
            del trainer._get_per_token_logps_and_entropies

    def __call__(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int,
                 batch_size: Optional[int] = None, compute_entropy: bool = False, compute_aux_loss: bool = False,
                 **images: Any) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        given = sorted(k for k, v in images.items() if v is not None)
        if given or compute_aux_loss:
            raise ValueError(f"odb's {self.layout} rollout layout got {given or 'compute_aux_loss=True'}. Rule: it "
                             f"lays out text rollouts without a router loss (enable_odb refuses the others). Fix: "
                             f"report the trainer and settings that reach this.")
        lay = layout_rows(input_ids, attention_mask, logits_to_keep, self.layout, self.pad_to_multiple_of,
                          self.pad_id)
        inputs = {"input_ids": lay.input_ids, "shift_labels": lay.shift_labels}
        if lay.attention_mask is not None:
            inputs["attention_mask"] = lay.attention_mask
        if lay.position_ids is not None:
            inputs["position_ids"] = lay.position_ids
        with self.trainer.accelerator.autocast():
            outputs = model(**inputs, fused_lm_head=True)
        self.tokens += int(lay.input_ids.numel())
        self.stand_in.calls += 1
        weights, self.weights = self.weights, None
        probe, self.bonus_probe = self.bonus_probe, None

        def back(values: torch.Tensor, weight: Optional[np.ndarray]) -> torch.Tensor:
            picked = values.reshape(-1)[lay.source.reshape(-1)].view(lay.source.shape)
            picked = torch.where(lay.scored, picked, torch.zeros((), dtype=picked.dtype, device=picked.device))
            if weight is None or bool((weight == 1.0).all()):
                return picked
            w = torch.as_tensor(weight, dtype=picked.dtype, device=picked.device)[:, None]
            return picked.detach() + w * (picked - picked.detach())  # the same values, the gradient times w

        entropies = None
        if compute_entropy:
            entropies = back(outputs.entropy, weights[1] if weights is not None else None)
            if probe is not None:
                entropies = entropies * (1 + probe.to(entropies.dtype)[:, None])
        return back(outputs.log_probs, weights[0] if weights is not None else None), entropies, None
