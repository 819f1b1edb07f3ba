"""Rows of an RL trainer's training slice (GRPO, RLOO): what each of TRL's keys holds, lengths, a micro-batch of rows.

TRL hands each training step a dict of rollout tensors (``_generate_and_score_completions``):
prompts left-padded (``prompt_ids``, ``prompt_mask``), completions right-padded
(``completion_ids``, ``completion_mask``, zero after the end of a completion) and values computed
at generation, each per completion token (old, reference and, with vLLM or a ``rollout_func``,
sampling log-probabilities; ``tool_mask``), per row (``advantages``, RLOO's ``old_logps``) or, for
vLLM's importance-sampling ratio, either (per token in the ``token_*`` modes of
``vllm_importance_sampling_mode``, one per row in the ``sequence_*`` modes), with a 0-d
``num_items_in_batch``. ``RolloutKeys`` says which, from odb's list of TRL's keys and the trainer's
settings (``rollout_keys``, at ``enable_odb``), and checks every slice against it: a key odb does
not know, or a value of another shape than its kind, stops the step naming it. Nothing is guessed
from shapes.

A micro-batch takes some rows and keeps only the last ``prompt_width`` prompt columns and the
first ``completion_width`` completion columns: the columns cut are padding in every row taken
(masked out of attention and out of every loss term), and a causal model's outputs at the columns
kept do not depend on them. Where a micro-batch needs padding (rows moved between ranks), each key
is padded with TRL's own value for a padded token (``pads``: 1 for ``tool_mask``, the corrected
ratio of a token without mismatch for ``importance_sampling_ratio``, else 0).

Example:
    >>> import torch
    >>> inputs = {"prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
    ...           "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
    ...           "completion_ids": torch.tensor([[3, 0, 0], [4, 4, 0]]),
    ...           "completion_mask": torch.tensor([[1, 0, 0], [1, 1, 0]]), "advantages": torch.tensor([0.5, -0.5]),
    ...           "num_items_in_batch": torch.tensor(3)}
    >>> TRL_KEYS.check(inputs, "GRPOTrainer")
    >>> [x.tolist() for x in rollout_lengths(inputs)], row_tokens(inputs)[0].tolist()
    ([[2, 3], [1, 2]], [1, 2])
    >>> piece = take_rows(inputs, [0], prompt_width=2, completion_width=1)
    >>> piece["prompt_ids"].tolist(), piece["completion_mask"].tolist(), piece["num_items_in_batch"].item()
    ([[5, 6]], [[1]], 3)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["IS_MODES", "PROMPT", "COMPLETION", "ROW", "SHARED", "RolloutKeys", "TRL_KEYS", "loss_mask",
           "rollout_keys", "rollout_lengths", "row_tokens", "take_rows"]

PROMPT, COMPLETION, ROW, SHARED = "prompt", "completion", "row", "shared"
# TRL 1.16's rollout keys (GRPOTrainer's and RLOOTrainer's _generate_and_score_completions) and what each holds:
# prompt columns (left-padded), completion columns (right-padded), one value per row, or one value for the slice.
_TRL_LAYOUTS = {"prompt_ids": PROMPT, "prompt_mask": PROMPT, "completion_ids": COMPLETION,
                "completion_mask": COMPLETION, "tool_mask": COMPLETION, "old_per_token_logps": COMPLETION,
                "ref_per_token_logps": COMPLETION, "sampling_per_token_logps": COMPLETION, "advantages": ROW,
                "old_logps": ROW, "num_items_in_batch": SHARED}
_TRL_PADS = {"tool_mask": 1.0}  # TRL pads tool_mask with 1 (completion_mask zeroes the padding)
# vllm_importance_sampling_mode -> the ratio's kind: one per completion token, or one per row.
IS_MODES = {"token_truncate": COMPLETION, "token_mask": COMPLETION, "sequence_truncate": ROW, "sequence_mask": ROW}
_VISION = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "image_sizes")


@dataclass(frozen=True)
class RolloutKeys:
    """TRL's rollout keys as a trainer's settings make them: ``layouts`` (key -> ``PROMPT``, ``COMPLETION``, ``ROW``,
    ``SHARED``) and ``pads`` (key -> TRL's value of a padded column, 0 when absent)."""

    layouts: Mapping[str, str]
    pads: Mapping[str, float] = field(default_factory=dict)

    def kind(self, key: str) -> str:
        return self.layouts[key]

    def pad(self, key: str) -> float:
        return float(self.pads.get(key, 0.0))

    def check(self, inputs: Mapping[str, Any], trainer_name: str) -> None:
        """Refuse a slice holding a key odb does not know for these settings, or a value whose shape is not its
        kind's (``PROMPT``: rows x prompt width; ``COMPLETION``: rows x completion width; ``ROW``: one value per
        row, ``(rows,)`` or ``(rows, 1)``; ``SHARED``: 0-d), naming it."""
        unknown = sorted(k for k, v in inputs.items() if k not in self.layouts and v is not None)
        if unknown:
            vision = [k for k in unknown if k in _VISION]
            raise ValueError(f"odb got {trainer_name} rollouts holding {unknown}, which odb does not know how to cut "
                             f"into micro-batches of rows (with these settings it cuts {sorted(self.layouts)}). "
                             f"Rule: every value of a micro-batch is one of TRL's rollout keys, as odb lists them"
                             + (" (vision-language rollouts are not supported)" if vision else "") +
                             f". Fix: train this {trainer_name} without odb's micro-batches, or pin the tested TRL "
                             f"(odb.private_api.TESTED).")
        rows, width_p = inputs["prompt_ids"].shape
        width_c = inputs["completion_ids"].shape[1]
        want = {PROMPT: ((rows, width_p),), COMPLETION: ((rows, width_c),), ROW: ((rows,), (rows, 1)), SHARED: ((),)}
        for key, value in inputs.items():
            if value is None:
                continue
            kind = self.layouts[key]
            shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
            if kind == SHARED and shape is None:
                continue
            if shape not in want[kind]:
                raise ValueError(f"odb got {trainer_name} rollouts whose {key!r} has shape {shape}. Rule: odb lists "
                                 f"{key!r} as a {kind} value here, of shape {' or '.join(map(str, want[kind]))} "
                                 f"for {rows} rows, prompts {width_p} and completions {width_c} wide. Fix: train "
                                 f"without odb's micro-batches, or report the trainer and settings that build it.")


TRL_KEYS = RolloutKeys(dict(_TRL_LAYOUTS), dict(_TRL_PADS))


def _is_pad(mode: str, low: Optional[float], high: Optional[float]) -> float:
    """TRL's corrected importance ratio of a token without mismatch (exp(0) = 1, then clipped or masked): the value
    TRL's padding columns hold.

    Example:
        >>> _is_pad("token_truncate", 0.5, 3.0), _is_pad("token_mask", 1.5, 3.0), _is_pad("token_truncate", 1.5, None)
        (1.0, 0.0, 1.5)
    """
    if mode.endswith("truncate"):
        return float(min(max(1.0, -math.inf if low is None else low), math.inf if high is None else high))
    return 1.0 if (low is None or low <= 1.0) and (high is None or 1.0 <= high) else 0.0


def rollout_keys(trainer: Any, trainer_name: str) -> RolloutKeys:
    """The keys a trainer's rollouts hold, as its settings make them (``importance_sampling_ratio`` per token or
    per row by ``vllm_importance_sampling_mode``, with vLLM and its correction on); an unknown mode is refused."""
    layouts, pads = dict(_TRL_LAYOUTS), dict(_TRL_PADS)
    if trainer_name == "GRPOTrainer" and trainer.use_vllm and trainer.vllm_importance_sampling_correction:
        mode = trainer.vllm_importance_sampling_mode
        if mode not in IS_MODES:
            raise ValueError(f"odb got {trainer_name} with vllm_importance_sampling_mode={mode!r}. Rule: odb cuts "
                             f"the importance-sampling ratio of the modes {sorted(IS_MODES)} (per token or per row). "
                             f"Fix: one of those modes, or train without odb.")
        layouts["importance_sampling_ratio"] = IS_MODES[mode]
        if IS_MODES[mode] == COMPLETION:
            pads["importance_sampling_ratio"] = _is_pad(mode, trainer.vllm_importance_sampling_clip_min,
                                                        trainer.vllm_importance_sampling_clip_max)
    return RolloutKeys(layouts, pads)


def loss_mask(inputs: Mapping[str, Any]) -> torch.Tensor:
    """The tokens TRL's loss counts: ``completion_mask``, times ``tool_mask`` when the rollouts have one."""
    mask = inputs["completion_mask"]
    tool = inputs.get("tool_mask")
    return mask if tool is None else mask * tool


def rollout_lengths(inputs: Mapping[str, Any]) -> Tuple[np.ndarray, np.ndarray]:
    """(prompt tokens, completion tokens) of every row: a prompt from its first token (left padding) to the end,
    a completion up to its last token in ``completion_mask`` (0 for a row masked whole)."""
    prompt_mask = inputs["prompt_mask"].detach().ne(0)
    completion_mask = inputs["completion_mask"].detach().ne(0)
    width_p, width_c = prompt_mask.shape[1], completion_mask.shape[1]
    first = torch.where(prompt_mask.any(1), prompt_mask.int().argmax(1), torch.full_like(prompt_mask[:, 0], width_p,
                                                                                          dtype=torch.long))
    cols = torch.arange(1, width_c + 1, device=completion_mask.device)
    last = (completion_mask * cols).amax(1) if width_c else torch.zeros(len(completion_mask), dtype=torch.long)
    return (width_p - first).cpu().numpy().astype(np.int64), last.cpu().numpy().astype(np.int64)


def row_tokens(inputs: Mapping[str, Any]) -> Tuple[np.ndarray, np.ndarray]:
    """(loss tokens, completion tokens) of every row: its tokens in ``loss_mask`` and in ``completion_mask``."""
    loss = loss_mask(inputs).detach().ne(0).sum(1)
    completion = inputs["completion_mask"].detach().ne(0).sum(1)
    return loss.cpu().numpy().astype(np.int64), completion.cpu().numpy().astype(np.int64)


def take_rows(inputs: Mapping[str, Any], rows: Sequence[int], prompt_width: int, completion_width: int,
              keys: RolloutKeys = TRL_KEYS) -> Dict[str, Any]:
    """The micro-batch of ``rows``: every per-row value indexed by them, prompt columns cut to the last
    ``prompt_width``, completion columns to the first ``completion_width`` (at most the slice's), as ``keys``
    says each key holds."""
    width_p = inputs["prompt_ids"].shape[1]
    width_c = inputs["completion_ids"].shape[1]
    keep_p, keep_c = min(int(prompt_width), width_p), min(int(completion_width), width_c)
    index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=inputs["prompt_ids"].device)
    out: Dict[str, Any] = {}
    for key, value in inputs.items():
        kind = keys.kind(key)
        if value is None or kind == SHARED:
            out[key] = value
            continue
        taken = value.index_select(0, index)
        if kind == PROMPT:
            taken = taken[:, width_p - keep_p:]
        elif kind == COMPLETION:
            taken = taken[:, :keep_c]
        out[key] = taken
    return out
