"""TRL's preference trainers under odb: ``DPOTrainer`` and ``RewardTrainer``, trained exactly.

A preference pair is one sample of the prepared dataset (DPO: ``prompt_ids``,
``chosen_ids``, ``rejected_ids``; reward: ``chosen_ids``, ``rejected_ids``) that TRL's
``DataCollatorForPreference`` turns into two rows, chosen and rejected (DPO: each with the
prompt, cut to ``max_length``), padded together to the longest row. Both trainers average
their loss over the pairs of a batch. What ``enable_odb`` sets for them (``pair_options``;
the user passes none of it):

- ``length_fn=PairLength(...)``: twice the pair's longer row. A micro-batch of B pairs whose
  longest row is L collates to 2B rows of L, and odb's padded cost B x 2L is exactly that;
  the collator's ``pad_to_multiple_of`` m becomes odb's 2m and a ``quadratic_length`` q the
  user sets becomes 2q, so the cost stays that of the collated rows;
- ``loss_scaling="sample"`` and ``loss_tokens_fn=PairUnits()`` (one per pair): each
  micro-batch's mean per pair is weighted by its share of the optimizer step's pairs over
  all ranks, which is the step's mean per pair, as TRL computes it with equal batches;
- ``compute_loss`` is called without ``return_outputs`` (DPO's fused LM head answers it with
  an extra forward) and its loss is not divided by the processes (neither trainer multiplies);
- under several processes, the metrics both trainers gather per pair (``accelerator.gather``
  of rewards, log-probabilities, scores) are joined whatever each rank's pair count
  (``ragged_gather``): odb's micro-batches hold a different number of pairs on each rank.

Refused, naming the value, the rule and the fix: odb options that contradict these
(``loss_scaling`` other than "sample", ``length_fn``, ``loss_tokens_fn``, ``lengths``,
``pad_to_multiple_of``, ``layout="packed"``, ``shape_buckets``, a tuple or ``"auto"``
``token_budget``), a collator other than TRL's text ``DataCollatorForPreference`` (DPO's
vision collator, a user's), DPO losses that are not a mean of per-pair terms (``aot``,
``aot_unpaired``, ``sft``) and DPO's MoE router auxiliary loss. Padding-free rows: TRL 1.x
turns ``DPOConfig(padding_free=True)`` off itself and ``RewardConfig`` has none, so the
batches are padded and odb follows them.

Example:
    >>> from trl import DPOConfig, DPOTrainer                                   # doctest: +SKIP
    >>> from odb.integrations.hf import enable_odb                              # doctest: +SKIP
    >>> trainer = DPOTrainer(model=model, ref_model=ref, args=DPOConfig("out"),
    ...                      train_dataset=pairs, processing_class=tokenizer)   # doctest: +SKIP
    >>> enable_odb(trainer, token_budget=16384).train()                         # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Mapping
from typing import Any, Dict, Iterator, Optional, Sequence

import numpy as np
import torch

from odb.config import ODBConfig
from odb.integrations.trl.rules import PAIR_TRAINERS, _given, trl_trainer_class

__all__ = ["PairLength", "PairUnits", "check_pairs_fit", "pair_options", "pair_trainer", "ragged_gather"]

# DPO loss types whose batch loss is not the mean of per-pair terms: "aot"/"aot_unpaired" sort the batch's log-ratios,
# "sft" averages the chosen tokens of the whole batch. Their gradient depends on which pairs share a micro-batch.
_BATCH_LOSSES = ("aot", "aot_unpaired", "sft")
_ALLOWED = {"layout": "padded", "pad_to_multiple_of": 1}  # values of the user's that agree with what odb sets


def pair_trainer(trainer: Any) -> Optional[str]:
    """``"DPOTrainer"`` or ``"RewardTrainer"`` when ``trainer`` is one of TRL's (or a user's subclass of it),
    else None.

    Example:
        >>> pair_trainer(object()) is None
        True
    """
    cls = trl_trainer_class(trainer)
    if cls is None or PAIR_TRAINERS.get(cls.__name__) != cls.__module__:
        return None
    return cls.__name__


class PairLength:
    """odb's length of one preference pair: twice its longer row as TRL's collator builds it.

    A row is ``prompt_key`` + ``chosen_ids`` (resp. ``rejected_ids``), cut to ``max_length``
    (DPO's collator cuts every row to it; ``None``: no cut). Picklable: it runs in the
    loader's workers.

    Example:
        >>> PairLength("prompt_ids", None)({"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]})
        10
        >>> PairLength("prompt_ids", 4)({"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6]})
        8
        >>> PairLength(None, None)({"chosen_ids": [1, 2, 3], "rejected_ids": [4]})
        6
    """

    def __init__(self, prompt_key: Optional[str], max_length: Optional[int]) -> None:
        self.prompt_key, self.max_length = prompt_key, max_length

    def __call__(self, sample: Mapping) -> int:
        prompt = len(sample[self.prompt_key]) if self.prompt_key is not None else 0
        longest = prompt + max(len(sample["chosen_ids"]), len(sample["rejected_ids"]))
        if self.max_length is not None:
            longest = min(longest, self.max_length)
        return 2 * longest

    def __repr__(self) -> str:
        return f"PairLength(prompt_key={self.prompt_key!r}, max_length={self.max_length})"


class PairUnits:
    """odb's loss count of one preference pair: 1 (the trainers average their loss per pair).

    Example:
        >>> PairUnits()({"chosen_ids": [1, 2], "rejected_ids": [3]})
        1
    """

    def __call__(self, sample: Mapping) -> int:
        return 1

    def __repr__(self) -> str:
        return "PairUnits()"


def _refuse(name: str, what: str, rule: str, fix: str) -> None:
    raise ValueError(f"odb cannot train this {name} with {what}. Rule: {rule}. Fix: {fix}.")


def _check_trainer(trainer: Any, name: str) -> Dict[str, Any]:
    """The collator's settings (``prompt_key``, ``max_length``, ``pad``), after refusing what odb cannot train
    exactly: another collator, DPO's batch-level losses and its router auxiliary loss."""
    module = sys.modules[PAIR_TRAINERS[name]]
    collator = trainer.data_collator
    own = getattr(module, "DataCollatorForPreference", None)
    if own is None or type(collator) is not own:
        _refuse(name, f"the data collator {getattr(collator, '__name__', type(collator).__name__)}",
                f"odb budgets a pair as the two rows of TRL's DataCollatorForPreference ({PAIR_TRAINERS[name]}), "
                f"the collator {name} builds for text pairs; it cannot tell the rows and length of another's "
                f"(DPO's vision-language collator processes images inside the collator)",
                f"leave data_collator out of the {name} (text pairs), or train this {name} without odb")
    if name == "DPOTrainer":
        batch = [t for t in getattr(trainer, "loss_types", ()) if t in _BATCH_LOSSES]
        if batch:
            how = "it sorts the log-ratios of the batch" if batch[0].startswith("aot") else \
                "it averages the chosen tokens of the batch"
            _refuse(name, f"loss_type={batch[0]!r}",
                    f"odb weights each micro-batch's loss by its share of the step's pairs, which is exact for a "
                    f"mean of per-pair terms; loss_type {batch[0]!r} depends on the whole batch ({how}), so odb's "
                    f"micro-batches would change it",
                    f"use a per-pair loss_type (e.g. 'sigmoid', 'ipo', 'hinge') with odb, or train without odb")
        if getattr(trainer, "aux_loss_enabled", False):
            _refuse(name, f"the router auxiliary loss (router_aux_loss_coef={trainer.router_aux_loss_coef})",
                    "a Mixture-of-Experts load-balancing loss is a mean over the batch's tokens, not over its pairs, "
                    "so odb's per-pair weights would change it",
                    "set router_aux_loss_coef=0.0 in the DPOConfig, or train without odb")
    prompt = "prompt_ids" if name == "DPOTrainer" else None
    return {"prompt_key": prompt, "max_length": getattr(collator, "max_length", None),
            "pad": int(getattr(collator, "pad_to_multiple_of", None) or 1)}


def pair_options(trainer: Any, config: Optional[ODBConfig], token_budget: Any, lengths: Optional[Sequence[int]],
                 options: Dict[str, Any]) -> Dict[str, Any]:
    """odb options for TRL's ``DPOTrainer`` / ``RewardTrainer`` (see the module docstring); other trainers'
    options unchanged. Options of the user's that contradict them raise ``ValueError`` naming the fix.

    Example:
        >>> pair_options(object(), None, 4096, None, {"buffer_size": 64})  # not a preference trainer
        {'buffer_size': 64}
    """
    name = pair_trainer(trainer)
    if name is None:
        return options
    found = _check_trainer(trainer, name)
    out = dict(options)
    budget = token_budget if token_budget is not None else getattr(config, "token_budget", None)
    if budget == "auto" or isinstance(budget, (tuple, list)):
        _refuse(name, f"token_budget={budget!r}", "a pair is budgeted as its two rows in one length dimension "
                f"(2 x its longer row), which the memory model of token_budget='auto' and per-dimension budgets do "
                f"not measure", "pass one int token_budget (the most tokens of a collated micro-batch: rows x "
                f"longest row, 2 rows per pair)")
    scaling = _given("loss_scaling", config, out, None)
    if scaling not in (None, "sample"):
        _refuse(name, f"loss_scaling={scaling!r}", f"{name} averages its loss over the pairs of a batch, so odb "
                f"weights each micro-batch by its pairs (loss_scaling='sample'); token weights would not give "
                f"{name}'s gradient", "leave loss_scaling out (odb sets 'sample' for preference pairs)")
    for option, why in (("length_fn", "odb measures a pair as the two rows TRL's collator builds (PairLength)"),
                        ("loss_tokens_fn", "the loss is a mean per pair: odb counts pairs (PairUnits)"),
                        ("pad_to_multiple_of", f"odb follows the collator's pad_to_multiple_of (set it in the "
                                               f"{name[:-len('Trainer')]}Config), doubled for the pair's two rows"),
                        ("shape_buckets", "a bucket pads a batch's rows to a length, and a pair's length counts "
                                          "its two rows"),
                        ("layout", "TRL pads preference pairs into rows (DPOConfig(padding_free=True) is turned off "
                                   "by TRL 1.x, RewardConfig has none)")):
        value = _given(option, config, out, None)
        if value not in (None, _ALLOWED.get(option)):
            _refuse(name, f"{option}={value!r}", why, f"leave {option} out")
    if lengths is not None:
        _refuse(name, f"lengths=<{len(lengths)} values>", "odb measures each pair as twice its longer row "
                "(PairLength), and lengths of single rows would let micro-batches reach twice token_budget",
                "leave lengths out")
    out.update(loss_scaling="sample", length_fn=PairLength(found["prompt_key"], found["max_length"]),
               loss_tokens_fn=PairUnits())
    if found["pad"] > 1:
        out["pad_to_multiple_of"] = 2 * found["pad"]
    quadratic = _given("quadratic_length", config, out, None)
    if quadratic is not None:
        out["quadratic_length"] = 2 * quadratic  # 1 + 2L / 2q per token of B x 2L: 1 + L / q per token of 2B x L
    return out


def check_pairs_fit(trainer: Any, cfg: ODBConfig) -> None:
    """Refuse, at ``enable_odb``, a pair that alone exceeds the budget (both rows counted), when the dataset is a
    ``datasets.Dataset`` whose pair columns give the lengths without reading a sample.

    Example:
        >>> check_pairs_fit(object(), ODBConfig(token_budget=64))  # not a preference trainer: nothing to check
    """
    name = pair_trainer(trainer)
    if name is None or cfg.oversize != "error" or not isinstance(cfg.length_fn, PairLength):
        return
    pair_len = pair_lengths(trainer.train_dataset, cfg.length_fn)
    if pair_len is None:
        return
    from odb.loader.length_probe import first_oversize

    found = first_oversize(pair_len, cfg)
    if found is None:
        return
    index = int(np.argmax(pair_len))  # the longest pair: the budget it needs fits every pair
    _, length, needed = first_oversize(pair_len[index:index + 1], cfg) or found
    row = length[0] // 2
    config = f"{name[:-len('Trainer')]}Config"
    cut = ("TRL cuts every row to it" if name == "DPOTrainer" else "TRL drops longer pairs while preparing the data")
    limit = getattr(trainer.args, "max_length", None)
    raise ValueError(f"pair {index} of the training dataset collates to two rows of {row} tokens ({length[0]} in "
                     f"odb's cost, rows x longest row), so alone it exceeds token_budget={cfg.token_budget}. Rule: "
                     f"oversize='error' refuses such samples, and training would stop when odb reaches it. Fix: "
                     f"raise token_budget to at least {needed}, build the trainer with max_length="
                     f"{_longest_row(cfg)} or less in the {config} (now {limit}; {cut}), or pass oversize='alone' "
                     f"(its own batch) or 'skip'.")


def _longest_row(cfg: ODBConfig) -> int:
    """The longest row whose pair (two rows) fits the budget alone."""
    from odb.integrations.hf.data import longest_fitting

    return longest_fitting(cfg) // 2


def pair_lengths(dataset: Any, length: PairLength) -> Optional[np.ndarray]:
    """``length`` of every pair of a ``datasets.Dataset``, read from its Arrow list offsets (no sample is read);
    None for another dataset or one without the pair columns.

    Example:
        >>> from datasets import Dataset                                                    # doctest: +SKIP
        >>> ds = Dataset.from_dict({"chosen_ids": [[1, 2], [3]], "rejected_ids": [[4], [5, 6, 7]]})  # doctest: +SKIP
        >>> pair_lengths(ds, PairLength(None, None)).tolist()                               # doctest: +SKIP
        [4, 6]
    """
    keys = [k for k in (length.prompt_key, "chosen_ids", "rejected_ids") if k is not None]
    if type(dataset).__module__.split(".")[0] != "datasets" or not hasattr(dataset, "with_format") or \
            not all(k in getattr(dataset, "column_names", ()) for k in keys):
        return None
    import pyarrow.compute as pc

    table = dataset.with_format("arrow")[:]
    size = {k: pc.list_value_length(table.column(k)).to_numpy(zero_copy_only=False).astype(np.int64) for k in keys}
    prompt = size[length.prompt_key] if length.prompt_key is not None else 0
    longest = prompt + np.maximum(size["chosen_ids"], size["rejected_ids"])
    if length.max_length is not None:
        longest = np.minimum(longest, length.max_length)
    return 2 * longest


@contextlib.contextmanager
def ragged_gather(accelerator: Any) -> Iterator[None]:
    """Within the block, ``accelerator.gather`` joins tensors whose first dimension differs between the processes.

    TRL's preference trainers gather per-pair metrics (rewards, log-probabilities, the
    reward model's scores) with ``accelerator.gather``, an all-gather that needs the same
    shape on every rank; odb's micro-batches hold each rank's own number of pairs. Each
    tensor is padded to the longest rank's (``accelerator.pad_across_processes``), gathered,
    and every rank's padding dropped. Scalars, and a single process, take the plain gather.

    Example:
        >>> from types import SimpleNamespace
        >>> acc = SimpleNamespace(num_processes=1, gather=lambda t: t)
        >>> with ragged_gather(acc):
        ...     acc.gather(torch.ones(3)).tolist()
        [1.0, 1.0, 1.0]
    """
    if accelerator.num_processes <= 1:
        yield
        return
    plain, own = accelerator.gather, accelerator.__dict__.get("gather")

    def gather(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0:
            return plain(tensor)
        counts = plain(torch.tensor([tensor.shape[0]], device=tensor.device)).tolist()
        padded = accelerator.pad_across_processes(tensor, dim=0)
        joined, width = plain(padded), padded.shape[0]
        return torch.cat([joined[r * width:r * width + c] for r, c in enumerate(counts)])

    accelerator.gather = gather
    try:
        yield
    finally:
        if own is None:
            del accelerator.gather
        else:
            accelerator.gather = own
