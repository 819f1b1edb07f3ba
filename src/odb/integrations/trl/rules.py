"""TRL's ``SFTTrainer`` rules that odb applies: what its collator implies for odb's options.

Shared by ``odb.integrations.hf.trainer`` (``enable_odb`` applies them to any Trainer
holding TRL's collator) and ``odb.integrations.trl`` (which re-exports them), so the
imports run one way: both import this module; it imports neither. It imports neither
TRL nor transformers: what is read comes from the objects the trainer already holds.
The module docstring of ``odb.integrations.trl`` describes the rules.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from typing import Any, Dict, Optional

import torch

from odb.config import ODBConfig

__all__ = ["IGNORE_INDEX", "PAIR_TRAINERS", "SFTLossTokens", "check_trl_trainer", "sft_options", "sft_computes_loss",
           "trl_trainer_class"]

IGNORE_INDEX = -100  # the label TRL's collator writes for unsupervised tokens (and transformers' loss ignores)
_SFT_MODULE = "trl.trainer.sft_trainer"
# TRL's preference trainers odb trains exactly (odb.integrations.trl.pairs), by the module that defines each.
PAIR_TRAINERS = {"DPOTrainer": "trl.trainer.dpo_trainer", "RewardTrainer": "trl.trainer.reward_trainer"}
# From TRL 1.15 SFTTrainer.compute_loss computes the loss itself through a fused LM head (no logits), multiplies it by
# the number of processes whenever average_tokens_across_devices and num_items_in_batch are set (whatever the model's
# accepts_loss_kwargs), and answers return_outputs=True with a FutureWarning and an extra no-grad forward.
_FUSED_LOSS_TRL = (1, 15)


def _version(text: str) -> tuple:
    """``"1.16.0"`` -> ``(1, 16, 0)``; a pre-release or local tail is dropped (``"1.15.0rc1"`` -> ``(1, 15, 0)``).

    Example:
        >>> _version("1.15.0rc1"), _version("0.24.0")
        ((1, 15, 0), (0, 24, 0))
    """
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    return tuple(int(g) for g in match.groups() if g is not None) if match else ()


# TRL's trainers that odb does not train exactly yet, and why (the rest of TRL's trainers: _OTHER).
_PAIRS = ("a preference pair collates to two rows (chosen and rejected, each with the prompt) that odb would "
          "budget as one, so a micro-batch can reach twice token_budget; and {name} averages its loss per pair "
          "where odb weights micro-batches by their supervised tokens, so the gradient would not be {name}'s")
_ROLLOUTS = ("odb's loader would replace TRL's RepeatSampler (the generations of one group would come from "
             "different prompts: wrong advantages), and {name} cuts its own generation batch into equal row "
             "slices, which odb's micro-batches do not follow")
# GRPO and RLOO: odb cuts their policy update instead (odb.integrations.trl.rl), reached through trl.enable_odb.
_RL = ("odb's loader would replace TRL's RepeatSampler (the generations of one group would come from different "
       "prompts: wrong advantages); odb cuts {name}'s policy update into token-budget micro-batches instead, "
       "leaving TRL's sampler, generation and rewards alone")
_RL_FIX = ("call odb.enable_odb(trainer, token_budget=...) (odb.integrations.trl.rl; odb.integrations.hf.enable_odb "
           "and odb.integrations.trl.enable_odb are the same call), not ODBTrainerMixin or ODBTrainer")
_WHY = {"CPOTrainer": _PAIRS, "ORPOTrainer": _PAIRS,
        "GRPOTrainer": _RL, "RLOOTrainer": _RL, "OnlineDPOTrainer": _ROLLOUTS}
_OTHER = ("its loss and batching are its own ({name} is not TRL's SFTTrainer, whose collator, labels and loss "
          "odb follows), and odb has not been shown to train it exactly")


def check_trl_trainer(trainer: Any) -> None:
    """Refuse a TRL trainer that odb does not train exactly (every one but ``SFTTrainer``, ``DPOTrainer``,
    ``RewardTrainer`` and subclasses of them made outside TRL), naming it, the reason and the fix; anything that
    is not TRL's passes.

    Example:
        >>> check_trl_trainer(object())   # not a TRL trainer: nothing to refuse
    """
    trl_class = trl_trainer_class(trainer)
    if trl_class is None or (trl_class.__name__ == "SFTTrainer" and trl_class.__module__ == _SFT_MODULE) or \
            PAIR_TRAINERS.get(trl_class.__name__) == trl_class.__module__:
        return
    name = trl_class.__name__
    why = _WHY.get(name, _OTHER).format(name=name)
    raise TypeError(f"odb cannot train TRL's {name} exactly: {why}. Rule: enable_odb takes a transformers Trainer "
                    f"whose loss is a token mean (Trainer, Seq2SeqTrainer, your subclasses), TRL's SFTTrainer, "
                    f"TRL's DPOTrainer or RewardTrainer (a mean per pair), and odb.integrations.trl.enable_odb "
                    f"takes TRL's GRPOTrainer and RLOOTrainer too (their policy update cut by tokens). Fix: "
                    + (_RL_FIX if _WHY.get(name) is _RL else f"train this {name} without odb (drop the enable_odb "
                       f"call), or fine-tune with SFTTrainer (preferences: DPOTrainer, RewardTrainer)") + ".")


def trl_trainer_class(trainer: Any) -> Any:
    """The first class of TRL's in ``trainer``'s class hierarchy (the TRL trainer a user's subclass extends), or
    None when it has none.

    Example:
        >>> trl_trainer_class(object()) is None
        True
    """
    return next((c for c in type(trainer).__mro__ if c.__module__.split(".")[0] == "trl"), None)


def sft_computes_loss(trainer: Any) -> bool:
    """Whether ``trainer`` is a TRL ``SFTTrainer`` whose ``compute_loss`` computes the loss itself (TRL >= 1.15: fused
    LM head, no logits; its cross-rank factor applies whenever ``average_tokens_across_devices``).

    Example:
        >>> sft_computes_loss(object())
        False
    """
    sft = sys.modules.get(_SFT_MODULE)
    if sft is None or not isinstance(trainer, sft.SFTTrainer):
        return False
    return _version(getattr(sys.modules.get("trl"), "__version__", "0")) >= _FUSED_LOSS_TRL


class SFTLossTokens:
    """Supervised tokens of one prepared SFT sample, as TRL's collator labels it and the model's loss counts it.

    A token counts when its label (``labels``, else ``input_ids``) is not -100, it lies
    inside ``completion_mask`` (when ``completion_only_loss``) and inside
    ``assistant_masks`` (when the sample has them), and it is not the sample's first
    token when ``skip_first`` (the model shifts labels, or padding-free rows mask each
    sample's first position). ``masks=False`` (TRL >= 1.9, whose collator reads only
    ``labels``: the trainer wrote -100 outside the masks while preparing the dataset)
    leaves the mask columns out. Picklable: it runs in the loader's workers.

    Example:
        >>> count = SFTLossTokens(completion_only_loss=True)
        >>> count({"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1]})
        2
        >>> count({"input_ids": [5, 6, 7, 8]})
        3
        >>> SFTLossTokens(False, masks=False)({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8],
        ...                                    "assistant_masks": [0, 0, 0, 1]})
        2
    """

    def __init__(self, completion_only_loss: bool, skip_first: bool = True, masks: bool = True) -> None:
        self.completion_only_loss, self.skip_first = bool(completion_only_loss), bool(skip_first)
        self.masks = bool(masks)

    def __call__(self, sample: Mapping) -> int:
        labels = sample["labels"] if "labels" in sample else sample["input_ids"]
        keep = torch.as_tensor(labels).reshape(-1) != IGNORE_INDEX
        masks = [sample.get("assistant_masks")] if self.masks else []
        if self.completion_only_loss and self.masks:
            masks.append(sample.get("completion_mask"))
        for mask in masks:
            if mask is not None:
                keep &= torch.as_tensor(mask).reshape(-1) != 0
        return int(keep[1:].sum() if self.skip_first else keep.sum())

    def __repr__(self) -> str:
        return (f"SFTLossTokens(completion_only_loss={self.completion_only_loss}, skip_first={self.skip_first}, "
                f"masks={self.masks})")


def sft_options(trainer: Any, config: Optional[ODBConfig], options: Dict[str, Any], shift: bool) -> Dict[str, Any]:
    """odb options implied by a trainer with TRL's collator, checked against the user's; others unchanged.

    Called by ``odb.integrations.hf.enable_odb`` before it builds the config. ``shift``:
    whether the model's loss shifts labels (causal LM). Options the user set win, unless
    they contradict the collator (then ``ValueError`` naming the fix).

    Example:
        >>> sft_options(object(), None, {"buffer_size": 64}, True)  # not TRL's: unchanged
        {'buffer_size': 64}
    """
    sft = sys.modules.get(_SFT_MODULE)  # TRL's collator means TRL is imported already
    if sft is None:
        return options
    args = getattr(trainer, "args", None)
    if isinstance(trainer, sft.SFTTrainer) and getattr(args, "packing", False):
        raise ValueError(
            f"odb cannot batch an SFTTrainer with SFTConfig(packing=True, packing_strategy="
            f"{getattr(args, 'packing_strategy', None)!r}): TRL packs the dataset into rows of max_length="
            f"{getattr(args, 'max_length', None)} tokens before odb sees it, so every sample is a full row and a "
            f"token budget has no short and long samples left to group. Fix: packing=False; for padding-free rows "
            f"that odb fills to token_budget, set padding_free=True (and max_length=None, which TRL 1.x requires "
            f"with padding_free=True and no packing).")
    collator = getattr(trainer, "data_collator", None)
    vision = getattr(sft, "DataCollatorForVisionLanguageModeling", None)
    if vision is not None and isinstance(collator, vision):  # samples processed alone (odb.integrations.trl.vision)
        return _vision_options(collator, config, dict(options))
    if not isinstance(collator, sft.DataCollatorForLanguageModeling):
        return options  # a collator of the user's: odb counts labels as for any Trainer
    # TRL < 1.9: the collator builds the labels from completion_mask and assistant_masks (it has completion_only_loss);
    # from 1.9 the trainer builds them (-100 outside the masks) and truncates while it prepares the dataset, drops the
    # mask columns, and the collator reads labels only (a labels column of the user's is taken as it is, masks or not).
    completion_only = getattr(collator, "completion_only_loss", None)
    return _collator_options(collator, config, dict(options), shift, completion_only)


def _vision_options(collator: Any, config: Optional[ODBConfig], out: Dict[str, Any]) -> Dict[str, Any]:
    """TRL's vision-language collator: odb's padded layout, its ``pad_to_multiple_of``; odb counts the labels it
    builds (the default count)."""
    name = type(collator).__name__
    check_layout(name, False, _given("layout", config, out, None), "",
                 "leave layout out (TRL pads vision-language batches; packed rows with images are not supported)")
    pad = int(collator.pad_to_multiple_of or 1)
    given = _given("pad_to_multiple_of", config, out, None)
    if given is None and pad > 1:
        out["pad_to_multiple_of"] = pad
    elif given is not None and given % pad:
        raise ValueError(f"odb got pad_to_multiple_of={given} but {name} pads to a multiple of {pad}. Rule: odb's "
                         f"padded length must not be shorter than the collator's, or batches exceed token_budget. "
                         f"Fix: pass pad_to_multiple_of={pad} (or a multiple of it), or leave it out.")
    return out


def _given(name: str, config: Optional[ODBConfig], options: Dict[str, Any], default: Any) -> Any:
    """The user's value of an option (keyword first, then config), or ``default`` when neither sets it."""
    if name in options:
        return options[name]
    value = getattr(config, name) if config is not None else default
    return default if value == getattr(ODBConfig, name, default) else value


def check_layout(name: str, packed: bool, layout: Any, fix_padded: str, fix_packed: str) -> None:
    """Refuse a ``layout`` that contradicts what the collator ``name`` builds: padding-free rows (``packed``)
    or padded rows; the fixes are the caller's (each names its own switch)."""
    if packed and layout == "padded":
        raise ValueError(f"odb got layout='padded' but {name} flattens each batch into one padding-free row. Rule: "
                         f"odb budgets a padding-free row as layout='packed' (the sum of its samples' lengths). "
                         f"Fix: {fix_padded}.")
    if not packed and layout == "packed":
        raise ValueError(f"odb got layout='packed' but {name} pads each batch into rows, which then cost the longest "
                         f"sample times the rows, beyond a budget planned on the sum of lengths. Fix: {fix_packed}.")


def _collator_options(collator: Any, config: Optional[ODBConfig], out: Dict[str, Any], shift: bool,
                      completion_only: Optional[bool]) -> Dict[str, Any]:
    name = type(collator).__name__
    padding_free = bool(collator.padding_free)
    flag = f"{name}(padding_free={padding_free})"
    layout = _given("layout", config, out, None)
    check_layout(flag, padding_free, layout,
                 "leave layout out (odb follows the collator), or set padding_free=False in the SFTConfig",
                 "set padding_free=True in the SFTConfig, or leave layout out")
    if padding_free:
        out["layout"] = "packed"
    pad = int(collator.pad_to_multiple_of or 1)
    given = _given("pad_to_multiple_of", config, out, None)
    if padding_free and pad > 1:
        raise ValueError(f"{name} has pad_to_multiple_of={pad} with padding_free=True: it pads each padding-free "
                         f"row up to a multiple of {pad}, beyond the sum of lengths that odb fills to token_budget. "
                         f"Rule: a packed row has no padding. Fix: pad_to_multiple_of=None in the SFTConfig.")
    if not padding_free and given is None and pad > 1:
        out["pad_to_multiple_of"] = pad
    elif not padding_free and given is not None and given % pad:
        raise ValueError(f"odb got pad_to_multiple_of={given} but {name} pads to a multiple of {pad}. Rule: odb's "
                         f"padded length must not be shorter than the collator's, or batches exceed token_budget. "
                         f"Fix: pass pad_to_multiple_of={pad} (or a multiple of it), or leave it out.")
    ignore = _given("ignore_index", config, out, IGNORE_INDEX)
    if ignore != IGNORE_INDEX:
        raise ValueError(f"odb got ignore_index={ignore} but {name} marks unsupervised labels with {IGNORE_INDEX}, "
                         f"as the model's loss ignores them. Fix: leave ignore_index out.")
    if _given("loss_tokens_fn", config, out, None) is None:
        out["loss_tokens_fn"] = SFTLossTokens(bool(completion_only), skip_first=shift or padding_free,
                                              masks=completion_only is not None)
    return out
