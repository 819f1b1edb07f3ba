"""The transformers data collators odb recognises, and the supervised tokens each one trains on.

odb scales the loss from each sample's supervised-token count, taken before the
collator runs (docs/algorithm.md). A collator that builds the labels itself changes
that count, so each of transformers' standard collators maps to an exact count here:

- ``DataCollatorForLanguageModeling(mlm=False)``: labels are the ``input_ids`` with the
  pad token masked (``InputTokens``: the tokens that are not ``pad_token_id``, minus the
  first when the model's loss shifts labels). Note that a tokenizer whose pad token is
  its eos token masks the eos tokens too, exactly as the collator does;
- ``DataCollatorForLanguageModeling(mlm=True)``: the collator draws the masked tokens
  at random, so no count exists before it runs: the HF Trainer counts them in the
  collated batches instead (``count_after_collate``; one all-reduce per optimizer step
  under DDP, the same collective the Trainer runs without odb);
- ``DataCollatorWithPadding``: sequence classification or regression, the sample's
  ``label`` / ``labels`` / ``label_ids`` (``LabelTokens``: one per sample for a class
  index, one per entry for a multi-label vector);
- ``DataCollatorForSeq2Seq``: the sample's ``labels`` (odb's default count); labels
  padded with anything but -100 are refused;
- ``DataCollatorWithFlattening``: one padding-free row per batch, odb's
  ``layout="packed"`` (``FlattenedTokens``: ``labels`` or ``input_ids`` without the
  sample's first token, which the collator masks with ``separator_id``);
- TRL's collators: ``odb.integrations.trl``.

A causal LM with left padding (``tokenizer.padding_side == "left"``) drops the first
column of each row, not each sample's first token, so its count depends on the batch:
it is counted after collate too. Each collator's ``pad_to_multiple_of`` becomes odb's
(a padded batch then stays within the budget); ``padding="max_length"`` is refused
(every batch would be max_length wide, whatever odb planned).

Example:
    >>> from odb.integrations.hf.collators import InputTokens
    >>> InputTokens(pad_token_id=0, skip_first=True)({"input_ids": [5, 6, 0, 7]})
    2
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from typing import Any, Dict, Optional

import torch

from odb.config import ODBConfig
from odb.integrations.trl.rules import check_layout

__all__ = ["CollatorRules", "FlattenedTokens", "InputTokens", "LabelTokens", "collator_options", "collator_rules"]

IGNORE_INDEX = -100  # what transformers' losses ignore and its collators pad labels with
_LABEL_KEYS = ("labels", "label", "label_ids")  # DataCollatorWithPadding renames the last two to labels


class InputTokens:
    """Supervised tokens of a sample for ``DataCollatorForLanguageModeling(mlm=False)``: input_ids that are
    not the pad token (the collator masks those), without the first one when ``skip_first``.

    Picklable: it runs in the loader's workers.

    Example:
        >>> InputTokens(pad_token_id=None, skip_first=False)([4, 5, 6])
        3
    """

    def __init__(self, pad_token_id: Optional[int], skip_first: bool) -> None:
        self.pad_token_id, self.skip_first = pad_token_id, bool(skip_first)

    def __call__(self, sample: Any) -> int:
        ids = sample["input_ids"] if isinstance(sample, Mapping) else sample
        ids = torch.as_tensor(ids).reshape(-1)
        if self.skip_first:
            ids = ids[1:]
        return int(ids.numel() if self.pad_token_id is None else (ids != self.pad_token_id).sum())

    def __repr__(self) -> str:
        return f"InputTokens(pad_token_id={self.pad_token_id}, skip_first={self.skip_first})"


class LabelTokens:
    """Supervised entries of a sample's ``labels`` (or ``label``, ``label_ids``): a class index or a
    regression target counts 1, a vector (multi-label, token labels) its entries != ``ignore_index``
    (without the first when ``skip_first`` and the labels are a sequence); no label counts 0.

    Example:
        >>> count = LabelTokens()
        >>> count({"input_ids": [4, 5, 6], "label": 1}), count({"input_ids": [4], "labels": [0.0, 1.0, 1.0]})
        (1, 3)
    """

    def __init__(self, ignore_index: int = IGNORE_INDEX, skip_first: bool = False) -> None:
        self.ignore_index, self.skip_first = ignore_index, bool(skip_first)

    def __call__(self, sample: Mapping) -> int:
        for key in _LABEL_KEYS:
            if key in sample and sample[key] is not None:
                labels = torch.as_tensor(sample[key])
                break
        else:
            return 0
        if labels.ndim == 0:
            return int(labels != self.ignore_index)
        labels = labels.reshape(-1)
        if self.skip_first:
            labels = labels[1:]
        return int((labels != self.ignore_index).sum())

    def __repr__(self) -> str:
        return f"LabelTokens(ignore_index={self.ignore_index}, skip_first={self.skip_first})"


class FlattenedTokens:
    """Supervised tokens of a sample in ``DataCollatorWithFlattening``'s row: its ``labels`` (else its
    ``input_ids``) without the first token, which the collator replaces by ``separator_id`` (-100).

    Example:
        >>> FlattenedTokens()({"input_ids": [4, 5, 6], "labels": [-100, 5, -100]})
        1
    """

    def __call__(self, sample: Mapping) -> int:
        labels = torch.as_tensor(sample["labels"] if "labels" in sample else sample["input_ids"]).reshape(-1)
        return int((labels[1:] != IGNORE_INDEX).sum())

    def __repr__(self) -> str:
        return "FlattenedTokens()"


@dataclasses.dataclass(frozen=True)
class CollatorRules:
    """What a recognised collator implies for odb.

    Attributes:
        options: odb options (the user's, with the collator's added).
        count_after_collate: no per-sample count exists before the collator runs (random
            masking, left padding with a causal shift); the trainer counts the collated labels.
        packed: the collator builds one padding-free row per batch (odb's packed layout).
        name: the collator, as a message names it.
    """

    options: Dict[str, Any]
    count_after_collate: bool = False
    packed: bool = False
    name: str = ""


def collator_label(collator: Any) -> str:
    """How a message names a collator: its class, or a function's name.

    Example:
        >>> def collate(samples): return samples
        >>> collator_label(collate)
        'the data collator collate()'
    """
    name = getattr(collator, "__name__", None)
    return f"the data collator {name}()" if isinstance(name, str) else type(collator).__name__


def _given(name: str, config: Optional[ODBConfig], options: Dict[str, Any]) -> Any:
    """The user's value of an option (keyword first, then a config's non-default value); None when unset."""
    if name in options:
        return options[name]
    if config is None:
        return None
    value = getattr(config, name)
    return None if value == getattr(ODBConfig, name, None) else value


def _transformers_collators() -> Dict[str, type]:
    module = sys.modules.get("transformers.data.data_collator")  # the collator exists: it is imported
    if module is None:
        return {}
    names = ("DataCollatorForLanguageModeling", "DataCollatorWithPadding", "DataCollatorForSeq2Seq",
             "DataCollatorWithFlattening")
    return {n: getattr(module, n) for n in names if hasattr(module, n)}


def _kind(collator: Any) -> Optional[str]:
    for name, cls in _transformers_collators().items():
        if isinstance(collator, cls):
            return name
    return None


def collator_rules(collator: Any, *, shift_labels: bool, config: Optional[ODBConfig] = None,
                   options: Optional[Dict[str, Any]] = None) -> Optional[CollatorRules]:
    """The rules of one of transformers' standard collators (None for any other collator).

    ``shift_labels``: whether the model's loss drops each row's first label (causal LM).
    Options the user set win, unless they contradict the collator (``ValueError`` naming
    the fix). A ``loss_tokens_fn`` of the user's is kept as given.

    Example:
        >>> collator_rules(lambda samples: samples, shift_labels=True) is None
        True
    """
    kind = _kind(collator)
    if kind is None:
        return None
    out = dict(options or {})
    after = False
    own_count = _given("loss_tokens_fn", config, out) is not None
    tokenizer = getattr(collator, "tokenizer", None)
    left = getattr(tokenizer, "padding_side", "right") == "left"
    packed = kind == "DataCollatorWithFlattening"
    name = f"{kind}(mlm={collator.mlm})" if kind == "DataCollatorForLanguageModeling" else kind
    _check_padding(collator, name)
    check_layout(name, packed, _given("layout", config, out), "leave layout out (odb follows the collator)",
                 "leave layout out, or collate with transformers.DataCollatorWithFlattening for padding-free rows")
    if packed:
        out["layout"] = "packed"
        separator = getattr(collator, "separator_id", IGNORE_INDEX)
        if separator != IGNORE_INDEX:
            raise ValueError(f"{name} has separator_id={separator}: the first label of every sample in its row is "
                             f"{separator}, which the model's loss counts as a supervised token. Rule: a packed "
                             f"row masks each sample's first label with {IGNORE_INDEX}. Fix: "
                             f"DataCollatorWithFlattening(separator_id={IGNORE_INDEX}) (its default).")
        count: Any = FlattenedTokens()
    elif kind == "DataCollatorForLanguageModeling" and collator.mlm:
        count, after = None, True  # the collator draws the masked tokens: nothing to count before it runs
    elif kind == "DataCollatorForLanguageModeling":
        count = InputTokens(getattr(tokenizer, "pad_token_id", None), skip_first=shift_labels)
        after = shift_labels and left
    elif kind == "DataCollatorWithPadding":
        count = LabelTokens(IGNORE_INDEX, skip_first=shift_labels)
        after = shift_labels and left
    else:  # DataCollatorForSeq2Seq: the samples' own labels, odb's default count
        count = None
        after = shift_labels and left
        label_pad = getattr(collator, "label_pad_token_id", IGNORE_INDEX)
        scaling = _given("loss_scaling", config, out) or "exact"
        if label_pad != IGNORE_INDEX and scaling in ("exact", "approx"):
            raise ValueError(f"{name} pads labels with label_pad_token_id={label_pad}, which the model's loss "
                             f"counts as supervised tokens, so each batch's loss depends on its padding. Rule: "
                             f"loss_scaling={scaling!r} needs padding left out of the loss. Fix: "
                             f"label_pad_token_id={IGNORE_INDEX} (the collator's default), or loss_scaling='none'.")
    if count is not None and not own_count:
        out["loss_tokens_fn"] = count
    if not packed:
        _adopt_pad_multiple(collator, name, config, out)
    return CollatorRules(out, count_after_collate=after and not own_count, packed=packed, name=name)


def collator_options(collator: Any, *, shift_labels: bool) -> Dict[str, Any]:
    """The ``ODBDataLoader`` options for a loop of your own that collates with ``collator``.

    For a collator whose supervised tokens exist only after it runs (masked-LM's random
    masking, left padding with a causal shift) this is ``loss_scaling="none"``
    (``loss_scale`` 1.0): weight each micro-batch's mean loss by its collated count
    yourself (docs/integration-guides/hf-trainer.md). An unrecognised collator gives ``{}``.

    Example:
        >>> collator_options(lambda samples: samples, shift_labels=True)
        {}
    """
    rules = collator_rules(collator, shift_labels=shift_labels)
    if rules is None:
        return {}
    options = dict(rules.options)
    if rules.count_after_collate:
        options.pop("loss_tokens_fn", None)
        options["loss_scaling"] = "none"
    if not rules.packed:
        options["shift_labels"] = bool(shift_labels)
    return options


def _check_padding(collator: Any, name: str) -> None:
    padding = getattr(collator, "padding", True)
    if str(getattr(padding, "value", padding)) == "max_length":
        raise ValueError(f"{name} has padding='max_length' (max_length={getattr(collator, 'max_length', None)}): "
                         f"every batch is padded to that length, while odb sizes a batch by its longest sample, so "
                         f"batches would exceed token_budget. Fix: padding=True (to the longest sample, the "
                         f"default); odb's pad_to_multiple_of (or the collator's) rounds the width.")


def _adopt_pad_multiple(collator: Any, name: str, config: Optional[ODBConfig], out: Dict[str, Any]) -> None:
    pad = int(getattr(collator, "pad_to_multiple_of", None) or 1)
    given = _given("pad_to_multiple_of", config, out)
    if given is None:
        if pad > 1:
            out["pad_to_multiple_of"] = pad
    elif given % pad:
        raise ValueError(f"odb got pad_to_multiple_of={given} but {name} pads to a multiple of {pad}. Rule: odb's "
                         f"padded length must not be shorter than the collator's, or batches exceed token_budget. "
                         f"Fix: pass pad_to_multiple_of={pad} (or a multiple of it), or leave it out.")
