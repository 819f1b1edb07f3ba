"""TRL's metrics of a training slice, recombined from odb's micro-batches to the values TRL logs without odb.

TRL's ``_compute_loss`` appends its metrics to ``trainer._metrics["train"]`` once per call, each
gathered across ranks, and its ``log`` averages the entries since the last log. odb calls it once
per micro-step, so a slice leaves ``M`` entries where TRL leaves one. After the slice, odb
replaces each metric's ``M`` entries by the one TRL would have appended for the slice, by the
metric's rule (``metric_rules``, from TRL 1.16's ``_compute_loss`` and the trainer's settings):

- ``TOKENS`` (``kl``, ``entropy``, the clip ratios at ``importance_sampling_level="token"``): TRL
  divides the sum over every rank's loss tokens by their count, so the slice's value is the mean of
  the micro-steps' values weighted by their loss tokens over all ranks (``COMPLETION_TOKENS``:
  RLOO's entropy, over ``completion_mask``); a micro-batch one completion column wide counts its
  rows instead, as TRL counts a ``(rows, 1)`` value;
- ``ROWS`` (the clip ratios at the sequence level, VESPO's ``phi_seq``, RLOO's clip ratios): weighted
  by their rows over all ranks;
- ``MIN`` / ``MAX`` (``clip_ratio/low_min``, ``clip_ratio/high_max``): the least / greatest, NaN left
  out (TRL's ``nanmin`` / ``nanmax`` over every rank's rows);
- ``POLICY`` (``policy_loss``, with the entropy bonus): TRL's mean over ranks of each rank's policy
  loss on its slice; odb sums its micro-batches' policy shares (``odb.integrations.trl.rl_loss.
  share_value``, in TRL's units: before the division by the accumulation steps for the loss types
  that divide by them) and takes the mean over ranks;
- ``SAME`` (``entropy_coef``, appended at the optimizer step's last slice): one entry, the value.

A metric that TRL appended but that odb has no rule for, or appended another number of times
than odb called the loss, stops the step (``FrameworkDrift``: a TRL that logs otherwise than the
tested one).

Example:
    >>> rules = {"entropy": TOKENS, "clip_ratio/low_min": MIN}
    >>> logged = {"entropy": [9.0, 1.0, 2.0], "clip_ratio/low_min": [0.0, 0.5, 0.25]}   # 9.0: a slice before
    >>> combine_slice(logged, {"entropy": 1, "clip_ratio/low_min": 1}, rules,
    ...               {TOKENS: np.array([3.0, 1.0])}, steps=2, policy=None)
    >>> logged
    {'entropy': [9.0, 1.25], 'clip_ratio/low_min': [0.0, 0.25]}
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from odb.private_api import drift

__all__ = ["COMPLETION_TOKENS", "MAX", "MIN", "POLICY", "POLICY_BEFORE_ACCUMULATION", "ROWS", "SAME", "SliceMetrics",
           "TOKENS", "combine_slice", "metric_rules"]

TOKENS, COMPLETION_TOKENS, ROWS, MIN, MAX, POLICY, SAME = ("tokens", "completion_tokens", "rows", "min", "max",
                                                           "policy", "same")
WEIGHTED = (TOKENS, COMPLETION_TOKENS, ROWS)
# GRPO loss types whose policy_loss metric is the policy term before TRL divides it by the accumulation steps.
POLICY_BEFORE_ACCUMULATION = ("grpo", "sapo", "bnpo", "dr_grpo", "luspo")


def metric_rules(trainer_name: str, importance_sampling_level: str = "token") -> Dict[str, str]:
    """How each metric of TRL 1.16's ``_compute_loss`` combines over a slice's micro-steps (the module docstring).

    Example:
        >>> metric_rules("GRPOTrainer", "sequence")["clip_ratio/low_mean"], metric_rules("RLOOTrainer")["entropy"]
        ('rows', 'completion_tokens')
    """
    if trainer_name == "RLOOTrainer":
        return {"entropy": COMPLETION_TOKENS, "clip_ratio/low_mean": ROWS, "clip_ratio/high_mean": ROWS,
                "clip_ratio/region_mean": ROWS, "clip_ratio/low_min": MIN, "clip_ratio/high_max": MAX}
    ratio = ROWS if importance_sampling_level == "sequence" else TOKENS  # coef_1 is (rows, 1) at the sequence level
    return {"kl": TOKENS, "entropy": TOKENS, "clip_ratio/low_mean": ratio, "clip_ratio/high_mean": ratio,
            "clip_ratio/region_mean": ratio, "clip_ratio/low_min": MIN, "clip_ratio/high_max": MAX,
            "cispo_clip_ratio": ratio, "vespo/phi_seq_mean": ROWS, "policy_loss": POLICY, "entropy_coef": SAME}


@dataclass(frozen=True)
class SliceMetrics:
    """How a trainer's metrics combine (``rules``), and whether TRL logs ``policy_loss``: with the entropy bonus,
    whose per-row terms odb then splits off (``bonus``).

    Example:
        >>> from types import SimpleNamespace
        >>> SliceMetrics.of(SimpleNamespace(importance_sampling_level="token", _entropy_bonus_enabled=True,
        ...                                 entropy_coef=0.1), "GRPOTrainer").bonus
        True
    """

    rules: Mapping[str, str]
    bonus: bool

    @staticmethod
    def of(trainer: Any, trainer_name: str) -> "SliceMetrics":
        if trainer_name != "GRPOTrainer":
            return SliceMetrics(metric_rules(trainer_name), False)
        bonus = bool(trainer._entropy_bonus_enabled) and float(trainer.entropy_coef) != 0.0
        return SliceMetrics(metric_rules(trainer_name, trainer.importance_sampling_level), bonus)


def _weighted(values: List[float], weights: np.ndarray) -> float:
    total = float(np.sum(weights))
    if total <= 0:
        return 0.0  # TRL divides a zero sum by its count clamped at 1
    return float(np.sum(np.asarray(values, dtype=np.float64) * weights) / total)


def _extreme(values: List[float], pick: Any) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return float(pick(kept)) if kept else math.nan


def combine_slice(logged: Dict[str, List[float]], before: Mapping[str, int], rules: Mapping[str, str],
                  counts: Mapping[str, np.ndarray], steps: int, policy: Optional[float]) -> None:
    """Replace, in place, the entries each metric of ``logged`` (``trainer._metrics["train"]``) gained since
    ``before`` (its lengths then) over ``steps`` micro-steps by the one TRL logs for the slice. ``counts``: per
    weighted rule, the micro-steps' counts over all ranks; ``policy``: the slice's policy loss (the mean over ranks
    of their shares), None without one."""
    for key in list(logged):
        entries = logged[key]
        start = before.get(key, 0)
        added = entries[start:]
        if not added:
            continue
        rule = rules.get(key)
        if rule is None:
            raise drift("trl", "metrics of _compute_loss (odb recombines each from a slice's micro-batches to TRL's "
                        f"value: {sorted(rules)})", f"logs {key!r}, which odb has no rule for")
        if len(added) != steps:
            raise drift("trl", f"metric {key!r}, appended once per _compute_loss call",
                        f"appended it {len(added)} times in {steps} calls")
        if rule in WEIGHTED:
            value = _weighted(added, counts[rule])
        elif rule == MIN:
            value = _extreme(added, min)
        elif rule == MAX:
            value = _extreme(added, max)
        elif rule == POLICY:
            if policy is None:
                raise drift("trl", "policy_loss metric, logged with the entropy bonus", "logs it without")
            value = float(policy)
        else:
            value = float(added[-1])
        entries[start:] = [value]
