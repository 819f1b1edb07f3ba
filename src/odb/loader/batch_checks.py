"""Checks on the batches an odb loader hands to the training loop: mistakes that would train silently.

Two, each reported once per loader as a warning with the fix:

- a dict batch whose step info was never popped (``odb.step_info.UnpoppedCheck``): the
  model swallowed it with ``**batch`` and the loss went unscaled;
- the first batch's labels are a causal LM's (they repeat ``input_ids`` at every supervised
  position) while odb counts every label (``ShiftCheck``): HF causal LMs shift labels inside
  their loss, so each row's first label is not in the mean odb scales to.

Two errors, on any batch: with ``layout="packed"`` odb plans each batch as one padding-free
row of up to ``token_budget`` tokens; a collate that pads the planned samples into a batch of
several rows (the user's padding collator) makes a batch odb did not plan, up to samples x
longest tokens, over the budget, while the step infos still count a packed row
(``PackedRowCheck``). And no batch leaves odb over its budget (``BudgetCheck``): a sample longer
than the length odb planned it with, or a collate that pads past the longest sample, is refused.

All cost a dictionary lookup per batch; the label comparison runs on one batch only.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional

import torch

from odb.config import ODBConfig
from odb.step_info import ODBStepInfo, UnpoppedCheck

__all__ = ["BatchChecks", "BudgetCheck", "BudgetExceededError", "PackedBatchError", "PackedRowCheck", "ShiftCheck",
           "ShiftLabelsWarning"]


class ShiftLabelsWarning(UserWarning):
    """odb's supervised-token count and a causal LM's shifted loss disagree (see ``ShiftCheck``)."""


class ShiftCheck:
    """Looks at the first non-ghost dict batch with ``labels`` and ``input_ids`` tensors of one shape.

    Labels equal to ``input_ids`` at every supervised position (at least two of them) are a
    causal LM's unshifted labels: what ``DataCollatorForLanguageModeling(mlm=False)`` and most
    SFT pipelines build, and what HF causal LMs shift inside their loss. Then:

    - ``shift_labels`` left unset (None): odb counted every label, one token per row more
      than the loss averages over. Warns: pass ``shift_labels=True`` (or ``False`` to keep
      counting every label, for a model that does not shift).
    - ``shift_labels=True`` and odb's count of the batch is still not the shifted count:
      the samples carry no labels (the collator makes them), and odb counted every input
      token. Warns: pass ``loss_tokens_fn``.

    Nothing is checked with ``loss_tokens_fn`` (the user counts), packed rows (their collate
    masks each sample's first label), or ``loss_scaling`` "sample"/"none" (no token counts).

    Example:
        >>> import torch, warnings
        >>> ids = torch.tensor([[5, 6, 7, 8]])
        >>> info = ODBStepInfo(0, 0, 1, 1, 4, 4, 4, 4, 1.0, False)
        >>> with warnings.catch_warnings(record=True) as seen:
        ...     warnings.simplefilter("always")
        ...     ShiftCheck.applies(ODBConfig(token_budget=8)).check({"input_ids": ids, "labels": ids}, info)
        True
        >>> "shift_labels=True" in str(seen[0].message)
        True
    """

    def __init__(self, cfg: ODBConfig) -> None:
        self.cfg = cfg

    @classmethod
    def applies(cls, cfg: ODBConfig) -> Optional["ShiftCheck"]:
        """The check for a loader with these options, or None where odb's counts need no check."""
        if cfg.shift_labels is False or cfg.loss_tokens_fn is not None or cfg.layout == "packed" \
                or cfg.loss_scaling not in ("exact", "approx"):
            return None
        return cls(cfg)

    def check(self, batch: Any, info: ODBStepInfo, stacklevel: int = 2) -> bool:
        """Check ``batch`` if it can tell; True once decided (the loader then stops asking)."""
        if info.is_ghost or not isinstance(batch, Mapping):
            return not isinstance(batch, Mapping)  # a tuple/tensor batch has no named labels: nothing to see
        labels, ids = batch.get(self.cfg.label_key), batch.get("input_ids")
        if not (isinstance(labels, torch.Tensor) and isinstance(ids, torch.Tensor)) or labels.shape != ids.shape \
                or labels.dim() != 2:
            return True
        supervised = labels != self.cfg.ignore_index
        if int(supervised.sum()) < 2 or not bool((labels == ids)[supervised].all()):
            return True  # not a causal LM's labels (pre-shifted, seq2seq, token classes): every label counts
        shifted = int(supervised[:, 1:].sum())
        counted = info.local_loss_tokens
        where = f"odb counted {counted} supervised tokens in the first batch ({labels.shape[0]} rows)"
        if self.cfg.shift_labels is None and counted != shifted:
            warnings.warn(
                f"{where}, every label of its samples, but the batch's '{self.cfg.label_key}' repeat its "
                f"input_ids at every supervised position: a causal LM's labels, which HF causal LMs shift inside "
                f"their loss (a row's first label is never predicted), averaging over {shifted}. odb's exact "
                f"token mean is then off by one token per sample. Fix: ODBDataLoader(..., shift_labels=True) "
                f"(odb.apply and ODBConfig alike); pass shift_labels=False to keep counting every label, for a "
                f"model that does not shift.", ShiftLabelsWarning, stacklevel=stacklevel)
        elif self.cfg.shift_labels and counted != shifted and counted == int(supervised.sum()):
            warnings.warn(
                f"{where} but its '{self.cfg.label_key}', as a causal LM's shifted loss sees them (labels[:, 1:]), "
                f"hold {shifted}: the samples carry no '{self.cfg.label_key}' of their own (the collate_fn makes "
                f"them, as DataCollatorForLanguageModeling does), so odb counted every input token. Fix: tell "
                f"odb what the collator supervises, e.g. loss_tokens_fn=lambda s: len(s['input_ids']) - 1, or put "
                f"'{self.cfg.label_key}' in the samples.", ShiftLabelsWarning, stacklevel=stacklevel)
        return True


class PackedBatchError(ValueError):
    """odb planned a packed row and the collate_fn returned a padded batch of several rows."""


class PackedRowCheck:
    """With ``layout="packed"``: a non-ghost dict batch whose ``input_ids`` hold more than one row is refused.

    Example:
        >>> import torch
        >>> info = ODBStepInfo(0, 0, 2, 2, 5, 5, 7, 7, 1.0, False)
        >>> PackedRowCheck(ODBConfig(token_budget=8, layout="packed")).check({"input_ids": torch.ones(2, 4)}, info)
        Traceback (most recent call last):
        ...
        odb.loader.batch_checks.PackedBatchError: odb planned a packed row of 2 samples (7 tokens, ...
    """

    def __init__(self, cfg: ODBConfig) -> None:
        self.cfg = cfg

    def check(self, batch: Any, info: ODBStepInfo) -> None:
        """Raise ``PackedBatchError`` if ``batch`` is not one row."""
        if info.is_ghost or not isinstance(batch, Mapping):
            return
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] <= 1:
            return
        rows, width = ids.shape
        budget = self.cfg.token_budget if isinstance(self.cfg.token_budget, int) else None
        over = f", {rows * width / budget:.2f} x token_budget={budget}" if budget else ""
        raise PackedBatchError(
            f"odb planned a packed row of {info.local_samples} samples ({info.padded_tokens} tokens, "
            f"layout='packed') but the collate_fn returned input_ids of shape {tuple(ids.shape)}: a padded batch of "
            f"{rows} rows, {rows * width} tokens with padding{over}. Rule: with layout='packed' each batch is one "
            f"padding-free row (the samples end to end, position_ids restarting per sample), which is what the "
            f"budget and the step infos count. Fix: collate with odb.PackedCollate (odb.PackedCollate.for_model("
            f"model) for a vision-language model; in the HF Trainer, data_collator=...), or transformers' "
            f"DataCollatorWithFlattening; or keep your collator and use layout='padded'.")


class BudgetExceededError(ValueError):
    """A collated batch holds more tokens than any budget odb plans under."""


class BudgetCheck:
    """No batch leaves odb over its token budget without an error: a non-ghost dict batch whose ``input_ids``
    (rows x width, padding included; a packed row's tokens) hold more tokens than odb planned for it and than
    the largest budget the loader has planned under (``options()``: the loader's current options) is refused,
    naming its samples. odb plans every batch within
    the budget from its samples' lengths, so such a batch means that a sample is longer than the length odb
    planned it with, or that the collate pads past the longest sample. One sample alone over the budget under
    ``oversize="alone"`` is planned so; ``token_budget="auto"`` is checked by its own meters.

    Example:
        >>> import torch
        >>> check = BudgetCheck(lambda: ODBConfig(token_budget=8))
        >>> check.check({"input_ids": torch.ones(2, 4)}, ODBStepInfo(0, 0, 2, 2, 5, 5, 8, 8, 1.0, False))
        >>> check.check({"input_ids": torch.ones(2, 6)}, ODBStepInfo(0, 0, 2, 2, 5, 5, 8, 8, 1.0, False))
        Traceback (most recent call last):
        ...
        odb.loader.batch_checks.BudgetExceededError: odb planned a batch of 2 samples (ids (), 8 tokens with ...
    """

    def __init__(self, options: Callable[[], ODBConfig]) -> None:
        self.options = options
        self.limit = 0  # the largest budget seen so far

    def check(self, batch: Any, info: ODBStepInfo) -> None:
        """Raise ``BudgetExceededError`` if ``batch`` holds more tokens than the budget allows."""
        if info.is_ghost or not isinstance(batch, Mapping):
            return
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
            return
        rows, width = ids.shape
        tokens = rows * width
        if tokens <= info.padded_tokens:  # what odb planned, within the budget it planned under
            return
        cfg = self.options()
        if cfg.auto:
            return
        # set_token_budget applies from the next window: batches planned before it may still come. Under context
        # parallelism the budget is per GPU and a replica's micro-batch holds context_parallel times it.
        budgets = [cfg.token_budgets[0]] + [b for _, b in cfg.budget_schedule or ()]
        self.limit = limit = max([self.limit] + [cfg.context_parallel * b for b in budgets])
        if tokens <= limit or (info.local_samples == 1 and cfg.oversize == "alone"):
            return
        raise BudgetExceededError(
            f"odb planned a batch of {info.local_samples} samples (ids {tuple(info.sample_ids)}, {info.padded_tokens} "
            f"tokens with padding) within token_budget={limit}, but the collated input_ids have shape "
            f"{tuple(ids.shape)}: {tokens} tokens, {tokens / limit:.2f} x the budget. Rule: no batch leaves odb over "
            f"its budget. Cause: a sample longer than the length odb planned it with (stale lengths= or a length_fn "
            f"reading a stored length column: odb checks those per sample in the workers), or a collate_fn that pads "
            f"past the longest sample (padding='max_length', or a pad_to_multiple_of odb was not given). Fix: let "
            f"odb measure the samples (drop lengths= / length_fn) or recompute them, and pad to the longest sample "
            f"(pass the collator's pad_to_multiple_of to odb as pad_to_multiple_of).")


class BatchChecks:
    """The checks an odb loader runs as it hands out each batch (``handed_out``), and at an epoch's end.

    Example:
        >>> checks = BatchChecks(ODBConfig(token_budget=8))
        >>> checks.reset()   # a new epoch
    """

    __slots__ = ("popped", "shift", "packed", "budget")

    def __init__(self, cfg: ODBConfig, options: Optional[Callable[[], ODBConfig]] = None) -> None:
        self.popped = UnpoppedCheck(cfg.step_info_key)
        self.shift = ShiftCheck.applies(cfg)
        self.packed = PackedRowCheck(cfg) if cfg.layout == "packed" else None
        self.budget = BudgetCheck(options or (lambda: cfg))

    def handed_out(self, batch: Any, info: ODBStepInfo, stacklevel: int = 3) -> None:
        """``batch`` (carrying ``info``) goes to the training loop now; warnings point ``stacklevel`` up.

        Raises:
            PackedBatchError: ``layout="packed"`` and the batch is several padded rows.
            BudgetExceededError: the batch holds more tokens than the budget (``BudgetCheck``).
        """
        if self.packed is not None:
            self.packed.check(batch, info)
        self.budget.check(batch, info)
        self.popped.handed_out(batch, info, stacklevel + 1)
        if self.shift is not None and self.shift.check(batch, info, stacklevel + 1):
            self.shift = None

    def finished(self, stacklevel: int = 3) -> None:
        """The epoch ended: its last batch is checked."""
        self.popped.finished(stacklevel + 1)

    def reset(self) -> None:
        """A new iteration starts."""
        self.popped.reset()
