"""Rows of an RL trainer's training slice (GRPO, RLOO): their lengths, and a micro-batch of them trimmed.

TRL hands each training step a dict of rollout tensors: prompts left-padded
(``prompt_ids``, ``prompt_mask``), completions right-padded (``completion_ids``,
``completion_mask``, zero after the end of a completion) and per-row or per-token values
computed at generation (advantages, old and reference log-probabilities, ...), with a 0-d
``num_items_in_batch``. A micro-batch takes some rows and keeps only the last
``prompt_width`` prompt columns and the first ``completion_width`` completion columns: the
columns cut are padding in every row taken (masked out of attention and out of every loss
term), and a causal model's outputs at the columns kept do not depend on them.

Example:
    >>> import torch
    >>> inputs = {"prompt_ids": torch.tensor([[0, 5, 6], [7, 8, 9]]),
    ...           "prompt_mask": torch.tensor([[0, 1, 1], [1, 1, 1]]),
    ...           "completion_ids": torch.tensor([[3, 0, 0], [4, 4, 0]]),
    ...           "completion_mask": torch.tensor([[1, 0, 0], [1, 1, 0]]), "advantages": torch.tensor([0.5, -0.5]),
    ...           "num_items_in_batch": torch.tensor(3)}
    >>> [x.tolist() for x in rollout_lengths(inputs)]
    [[2, 3], [1, 2]]
    >>> piece = take_rows(inputs, [0], prompt_width=2, completion_width=1)
    >>> piece["prompt_ids"].tolist(), piece["completion_mask"].tolist(), piece["num_items_in_batch"].item()
    ([[5, 6]], [[1]], 3)
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Sequence, Tuple

import numpy as np
import torch

__all__ = ["PROMPT_KEYS", "COMPLETION_KEYS", "ROW_KEYS", "check_rollout_keys", "rollout_lengths", "take_rows"]

PROMPT_KEYS = ("prompt_ids", "prompt_mask")  # (rows, prompt width), left-padded
# (rows, completion width), right-padded; importance_sampling_ratio and advantages may also be (rows, 1) or (rows,)
COMPLETION_KEYS = ("completion_ids", "completion_mask", "tool_mask", "old_per_token_logps", "ref_per_token_logps",
                   "sampling_per_token_logps", "importance_sampling_ratio", "advantages")
ROW_KEYS = ("old_logps",)  # RLOO: one value per row
SHARED_KEYS = ("num_items_in_batch",)  # 0-d: the same for every micro-batch


def check_rollout_keys(inputs: Mapping[str, Any], trainer_name: str) -> None:
    """Refuse a slice holding a value odb does not know how to cut by rows (images of a vision-language
    rollout, a subclass's own column), naming it.

    Example:
        >>> check_rollout_keys({"prompt_ids": None, "num_items_in_batch": None}, "GRPOTrainer")
    """
    known = set(PROMPT_KEYS + COMPLETION_KEYS + ROW_KEYS + SHARED_KEYS)
    unknown = sorted(k for k, v in inputs.items() if k not in known and v is not None)
    if unknown:
        raise ValueError(f"odb got {trainer_name} rollouts holding {unknown}, which odb does not know how to cut "
                         f"into micro-batches of rows (it cuts {sorted(known)}). Rule: every value of a micro-batch "
                         f"must be the rows it trains on (vision-language rollouts, whose images are not one per "
                         f"row, are not supported). Fix: train this {trainer_name} without odb's micro-batches.")


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


def take_rows(inputs: Mapping[str, Any], rows: Sequence[int], prompt_width: int, completion_width: int
              ) -> Dict[str, Any]:
    """The micro-batch of ``rows``: every row-shaped value indexed by them, prompt columns cut to the last
    ``prompt_width``, completion-aligned columns to the first ``completion_width`` (at most the slice's)."""
    width_p = inputs["prompt_ids"].shape[1]
    width_c = inputs["completion_ids"].shape[1]
    n = inputs["prompt_ids"].shape[0]
    keep_p, keep_c = min(int(prompt_width), width_p), min(int(completion_width), width_c)
    index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=inputs["prompt_ids"].device)
    out: Dict[str, Any] = {}
    for key, value in inputs.items():
        if value is None or not isinstance(value, torch.Tensor) or value.ndim == 0:
            out[key] = value
            continue
        if value.shape[0] != n:
            raise ValueError(f"odb got rollouts whose {key!r} has {value.shape[0]} rows where prompt_ids has {n}. "
                             f"Rule: every per-row value of a training slice has one entry per row. Fix: train "
                             f"without odb's micro-batches, or report the trainer that builds such a slice.")
        taken = value.index_select(0, index)
        if key in PROMPT_KEYS:
            taken = taken[:, width_p - keep_p:]
        elif key in COMPLETION_KEYS and taken.ndim == 2 and taken.shape[1] == width_c:
            taken = taken[:, :keep_c]
        out[key] = taken
    return out
