"""One optimizer step of odb batches for the HF Trainer, and the checks that keep its loss exact.

The Trainer pulls ``gradient_accumulation_steps`` batches per optimizer step and steps
the optimizer after every ``gradient_accumulation_steps``-th micro-batch. With budget-filled
steps odb emits exactly that many micro-batches per step except the last of an epoch; with
``global_batch_size`` (the integration's default: the Trainer's own samples per step) a step
holds as many micro-batches as its samples need. ``pad_step`` fits a step into the Trainer's
slots: inert ``StepFiller`` entries in front of a shorter step (no forward or backward), or
``StepBundle`` slots of several micro-batches for a longer one, so the optimizer steps after
the step's last micro-batch either way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from odb.config import ODBConfig
from odb.data.lengths import batch_loss_tokens as count_batch_loss_tokens
from odb.step_info import ODBStepInfo, loss_scale, pop_step_info


class StepFiller(dict):
    """A placeholder micro-batch: no samples, no forward, no backward, zero loss."""


class StepBundle(dict):
    """Several micro-batches of one optimizer step in one of the Trainer's slots (``parts``), trained one
    after the other by ``ODBTrainerMixin.training_step``. A dict so that the Trainer's loop takes it."""

    def __init__(self, parts: List[Any]) -> None:
        super().__init__()
        self.parts = parts


def trainer_steps(args: Any, config: Optional[ODBConfig], options: Dict[str, Any]) -> Dict[str, Any]:
    """The options that make odb's optimizer steps the Trainer's: by default ``global_batch_size =
    per_device_train_batch_size x gradient_accumulation_steps x world_size`` (each step holds the samples the
    Trainer would have put in it); ``global_batch_size=None`` passed explicitly keeps budget-filled steps of
    ``gradient_accumulation_steps`` micro-batches (fewer, larger updates).

    Example:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(per_device_train_batch_size=4, gradient_accumulation_steps=8, world_size=2)
        >>> trainer_steps(args, None, {})
        {'global_batch_size': 64, 'gradient_accumulation_steps': 1}
        >>> trainer_steps(args, None, {"global_batch_size": None})
        {'global_batch_size': None, 'gradient_accumulation_steps': 8}
    """
    accumulation = args.gradient_accumulation_steps
    if "global_batch_size" in options:
        g = options["global_batch_size"]
    elif config is not None and config.global_batch_size is not None:
        g = config.global_batch_size
    else:
        g = args.per_device_train_batch_size * accumulation * args.world_size
    return {"global_batch_size": g, "gradient_accumulation_steps": 1 if g is not None else accumulation}


def make_filler(main_input_name: str) -> StepFiller:
    """A filler whose main input is empty (the Trainer counts 0 tokens and 0 FLOPs for it)."""
    return StepFiller({main_input_name: torch.zeros((1, 0), dtype=torch.long)})


def next_step(iterator: Iterator[Any], key: str) -> Optional[Tuple[List[Any], List[ODBStepInfo]]]:
    """The micro-batches of the next optimizer step and their step infos (popped); None at the end."""
    try:
        first = next(iterator)
    except StopIteration:
        return None
    batches, infos = [first], [pop_step_info(first, key)]
    if infos[0].micro_step != 0:
        raise RuntimeError(
            f"odb's training loader was at micro-batch {infos[0].micro_step} of an optimizer step when the Trainer "
            f"started a new step: something else consumed batches of trainer's training loader. Fix: do not iterate "
            f"the Trainer's training dataloader outside trainer.train().")
    for k in range(1, infos[0].micro_steps):
        try:
            batch = next(iterator)
        except StopIteration:
            raise RuntimeError(f"odb's training loader ended inside an optimizer step (after micro-batch {k} of "
                               f"{infos[0].micro_steps}). This is a bug in odb; please report it.") from None
        batches.append(batch)
        infos.append(pop_step_info(batch, key))
    return batches, infos


def pad_step(batches: List[Any], accumulation: int, main_input_name: str) -> List[Any]:
    """``batches`` in exactly ``accumulation`` slots: preceded by fillers when fewer, else in consecutive
    bundles of as equal sizes as they split into (a bundle of one is the batch itself).

    Example:
        >>> [type(s).__name__ for s in pad_step([{"a": 1}], 3, "input_ids")]
        ['StepFiller', 'StepFiller', 'dict']
        >>> [len(s.parts) if isinstance(s, StepBundle) else 1 for s in pad_step([{}] * 5, 2, "input_ids")]
        [3, 2]
    """
    if len(batches) <= accumulation:
        return [make_filler(main_input_name) for _ in range(accumulation - len(batches))] + batches
    sizes = [len(batches) // accumulation + (k < len(batches) % accumulation) for k in range(accumulation)]
    out, start = [], 0
    for size in sizes:
        part = batches[start:start + size]
        out.append(part[0] if size == 1 else StepBundle(part))
        start += size
    return out


def batch_loss_tokens(batch: Any, shift: bool, ignore_index: int) -> Optional[int]:
    """Supervised tokens of a collated batch as the model's loss sees them (None: no label tensor).

    ``shift_labels`` (as padding-free collators provide) is used as is; else ``labels``,
    without its first column when the loss shifts labels (causal LM): the Trainer's keys
    for ``odb.data.lengths.batch_loss_tokens``.
    """
    return count_batch_loss_tokens(batch, "labels", ignore_index, shift, shifted_key="shift_labels")


class SampleView:
    """One training sample read back for an error message (the dataset and the collator's name)."""

    def __init__(self, dataset: Any, collator: str) -> None:
        self.dataset, self.collator = dataset, collator

    def describe(self, info: ODBStepInfo, cfg: ODBConfig) -> str:
        """What odb saw in the batch's first sample and what its count assumed."""
        from odb.data.source import SampleMeter

        if not info.sample_ids or not hasattr(self.dataset, "__getitem__"):
            return ""
        index = info.sample_ids[0]
        try:
            sample = self.dataset[index]
            counted = SampleMeter(cfg)(None, sample)[1]
        except Exception:  # an IterableDataset's ids are arrival positions; a sample odb cannot read back
            return ""
        if not isinstance(sample, Mapping):
            return ""
        fields = [str(k) for k in sample]
        if cfg.loss_tokens_fn is not None:
            assumed = f"loss_tokens_fn={cfg.loss_tokens_fn!r} gives {counted} for it"
        elif cfg.label_key in sample:
            assumed = (f"its '{cfg.label_key}' != {cfg.ignore_index}"
                       f"{' without the first' if cfg.shift_labels or cfg.layout == 'packed' else ''} are the "
                       f"supervised tokens ({counted}) and {self.collator} keeps them")
        else:
            assumed = (f"without '{cfg.label_key}', all of its tokens are supervised ({counted}), but "
                       f"{self.collator} builds labels of its own")
        return f" What odb saw: sample {index} has the fields {fields}. What it assumed: {assumed}."


def recount_loss_tokens(batches: List[Any], infos: List[ODBStepInfo], cfg: ODBConfig, shift: bool,
                        all_ranks: Callable[[int], int]) -> List[ODBStepInfo]:
    """The step's infos with the supervised tokens counted in the collated batches (``all_ranks`` sums a
    count over the ranks: one collective per optimizer step, on every rank).

    For collators whose labels exist only once they have run (masked-LM's random masking,
    left padding under a causal shift): ``local_loss_tokens``, ``global_loss_tokens`` and
    ``loss_scale`` are recomputed as odb computes them from per-sample counts.
    """
    counts = [0 if i.is_ghost else (batch_loss_tokens(b, shift, cfg.ignore_index) or 0)
              for b, i in zip(batches, infos)]
    total = all_ranks(sum(counts))
    local = sum(counts)
    out = []
    for count, info in zip(counts, infos):
        scale = 0.0 if info.is_ghost else loss_scale(cfg.loss_scaling, count, total, local, info.world_size,
                                                     info.loss_scale)
        out.append(dataclasses.replace(info, local_loss_tokens=count, global_loss_tokens=total, loss_scale=scale))
    return out


def check_loss_tokens(batches: List[Any], infos: List[ODBStepInfo], cfg: ODBConfig, shift: bool,
                      view: Optional[SampleView] = None) -> None:
    """Refuse batches whose collated labels hold another token count than odb planned with.

    Exact scaling divides by odb's count (all ranks, all micro-batches); if the model
    averages over a different count, the gradient is silently off, so this is an error.
    ``view`` reads the batch's first sample back, for the message.
    """
    if cfg.loss_scaling not in ("exact", "approx"):
        return
    for batch, info in zip(batches, infos):
        if info.is_ghost:
            continue
        seen = batch_loss_tokens(batch, shift, cfg.ignore_index)
        if seen is None or seen == info.local_loss_tokens:
            continue
        what = "labels[..., 1:]" if shift else "labels"
        saw = view.describe(info, cfg) if view is not None else ""
        raise ValueError(
            f"odb counted {info.local_loss_tokens} supervised tokens in the batch of samples "
            f"{list(info.sample_ids[:8])}{'...' if len(info.sample_ids) > 8 else ''} but the collated batch holds "
            f"{seen} ({what} != {cfg.ignore_index}, as the model's loss counts them), so the loss could not be "
            f"scaled exactly.{saw} Fix: pass loss_tokens_fn=lambda s: <the supervised tokens the collator's labels "
            f"give that sample> (e.g. len(s['input_ids']) - 1 for labels = input_ids under a causal shift), or let "
            f"the dataset return the labels the model trains on; pad labels on the right; set shift_labels={shift} "
            f"to match the model's loss; or pass loss_scaling='sample' to weight samples instead of tokens. odb "
            f"counts transformers' DataCollatorForLanguageModeling, DataCollatorWithPadding, DataCollatorForSeq2Seq, "
            f"DataCollatorWithFlattening and TRL's collators by itself.")

