"""The Trainer's own steps under ``train_sampling_strategy="group_by_length"`` and ``"batch_rebalance"``.

Without odb the Trainer builds one sampler over the whole dataset (``Trainer._get_train_sampler``) and
Accelerate deals its batches of ``per_device_train_batch_size`` (B) to the W ranks in turn, so optimizer
step k holds the global order's B x A x W samples from position k x B x A x W on (A: accumulation).
``trainer_sampler`` gives odb's loader on rank r the same share, ``odb.BatchShardSampler`` over the
Trainer's sampler: every optimizer step holds the samples the Trainer would train on in it, and odb only
cuts them into micro-batches under the token budget (planned across ranks).

- ``group_by_length``: the Trainer's ``LengthGroupedSampler(B x A)``. Built without a generator, it draws
  its permutation from torch's global RNG when iterated, and the Trainer's loader iterates it once per
  epoch right after drawing its workers' base seed from that RNG (torch draws it whenever a DataLoader
  iterator is made, workers or not: "Randomness in multi-process data loading" in torch.utils.data's
  docs; with persistent workers only the first time). ``EpochDraw`` makes the same two draws, in that
  order, on the training thread when the Trainer sets the loader's epoch (right before it iterates it),
  and keeps the epoch's order; odb's own loaders then draw their base seeds from a generator of their own
  (``private_generator``), so nothing else of odb touches that RNG and the permutation, and every draw
  after it (dropout), are the Trainer's.
- ``batch_rebalance``: the Trainer's ``BatchRebalanceSampler`` takes step k's samples as a block of a
  seeded permutation (``effective_batch_size`` = B x A x W of them) and only rebalances them into each
  rank's micro-batches. ``RebalanceSteps`` reads each step's samples from a copy of it planned for one
  rank and one micro-batch (its rebalance then leaves the block whole); odb's global plan cuts them.

The ends of an epoch are Accelerate's too (``odb.BatchShardSampler``): with ``even_batches=True`` (its
default) on several processes the last round of batches is filled with samples from the epoch's start,
with ``dataloader_drop_last=True`` an incomplete last round is dropped. One difference is left:
``BatchRebalanceSampler`` fills a last step of fewer than W x A samples (``dataloader_drop_last=False``)
with samples from the start of its permutation; odb trains that step on its own samples only.

A checkpoint holds what draws the epoch's order again (``EpochDraw.state``), so a resume in the middle of an
epoch reads on in that order (``replay_order``; batch_rebalance's order is seeded by its epoch); a resume of
such an epoch on another number of ranks is refused with the fix. odb options that would change the steps
(another ``global_batch_size``, a ``composition``) are refused at ``enable_odb`` (``check_strategy``).

Example:
    >>> STRATEGIES
    ('group_by_length', 'batch_rebalance')
"""

from __future__ import annotations

import base64
import logging
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import IterableDataset, Sampler

from odb.data.batch_shard import BatchShardSampler

logger = logging.getLogger(__name__)

STRATEGIES = ("group_by_length", "batch_rebalance")


class RebalanceSteps(Sampler[int]):
    """The order of ``BatchRebalanceSampler``'s optimizer steps: its steps' samples, one step after another.

    ``sampler`` is the Trainer's ``BatchRebalanceSampler``; a copy of it with one rank and one micro-batch
    (``dp_size=1, grad_accum=1``) yields each step's ``effective_batch_size`` samples as one batch, drawn
    from the same seeded permutation (seed + epoch), so step k here holds the samples the Trainer's step k
    holds on all its ranks together. ``set_epoch`` reaches the copy, as the Trainer's reaches the original.

    Example:
        >>> from transformers.trainer_pt_utils import BatchRebalanceSampler
        >>> s = BatchRebalanceSampler(lengths=[3, 9, 4, 7, 5, 2], effective_batch_size=4, dp_size=2, grad_accum=2,
        ...                           drop_last=False)
        >>> order = list(RebalanceSteps(s))
        >>> mine = [list(BatchRebalanceSampler(lengths=s.lengths, effective_batch_size=4, dp_size=2, grad_accum=2,
        ...                                    rank=r, drop_last=False)) for r in (0, 1)]
        >>> sorted(order[:4]) == sorted(i for r in (0, 1) for batch in mine[r][:2] for i in batch)
        True
        >>> len(order)
        6
    """

    def __init__(self, sampler: Any) -> None:
        self.whole = type(sampler)(lengths=sampler.lengths, effective_batch_size=sampler.effective_batch_size,
                                   dp_size=1, grad_accum=1, shuffle=sampler.shuffle, seed=sampler.seed, rank=0,
                                   drop_last=sampler.drop_last)
        self.whole.set_epoch(sampler.epoch)

    def set_epoch(self, epoch: int) -> None:
        self.whole.set_epoch(epoch)

    def __len__(self) -> int:
        steps, rest = divmod(len(self.whole.lengths), self.whole.effective_batch_size)
        return steps * self.whole.effective_batch_size + (0 if self.whole.drop_last else rest)

    def __iter__(self) -> Iterator[int]:
        for step in self.whole:
            yield from step


class EpochDraw(Sampler[int]):
    """``sampler`` (one that draws from torch's global RNG when iterated) drawn where the Trainer's DataLoader
    draws it: ``set_epoch`` (the Trainer sets the loader's epoch right before it iterates it) first draws the
    base seed that the Trainer's DataLoader draws when it makes its iterator (``base_seed_once``: with
    persistent workers only the first time), then the epoch's order, on the calling thread; once per epoch
    (odb's resume sets the epoch too). Iterating gives that order until the next epoch's (a sampler never set
    is drawn at its first iteration). ``state()`` is what draws the current epoch's order again, in another
    process (``replay``): the RNG state it was drawn from, the draws before it, the epoch.

    Example:
        >>> drawn = EpochDraw(torch.utils.data.RandomSampler(range(5)), base_seed_once=False)
        >>> _ = torch.manual_seed(0); drawn.set_epoch(0)
        >>> _ = torch.manual_seed(0); _ = torch.empty((), dtype=torch.int64).random_()
        >>> list(drawn) == list(torch.utils.data.RandomSampler(range(5))) == list(drawn)
        True
        >>> again = EpochDraw(torch.utils.data.RandomSampler(range(5)), base_seed_once=False)
        >>> again.replay(drawn.state()); list(again) == list(drawn)
        True
    """

    def __init__(self, sampler: Any, base_seed_once: bool) -> None:
        self.sampler, self.base_seed_once = sampler, base_seed_once
        self.draws = 0  # orders drawn so far
        self.order: Optional[List[int]] = None
        self.epoch: Optional[int] = None  # the epoch of ``order``
        self.drawn_from: Optional[torch.Tensor] = None  # torch's RNG state ``order`` was drawn from

    def set_epoch(self, epoch: int) -> None:
        if self.order is not None and self.epoch == epoch:
            return  # drawn (or replayed) for this epoch already
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        self.draw(epoch)

    def draw(self, epoch: Optional[int] = None) -> None:
        """Draw the next epoch's order as the Trainer's loader does (see the class docstring)."""
        self.drawn_from = torch.get_rng_state()
        if self.draws == 0 or not self.base_seed_once:
            torch.empty((), dtype=torch.int64).random_()  # the base seed of the Trainer's DataLoader iterator
        self.draws += 1
        self.order, self.epoch = [int(i) for i in self.sampler], epoch

    def state(self) -> Optional[Dict[str, Any]]:
        """What ``replay`` needs to draw this epoch's order again (None before the first draw)."""
        if self.drawn_from is None:
            return None
        return {"rng": base64.b64encode(self.drawn_from.numpy().tobytes()).decode("ascii"),
                "draws_before": self.draws - 1, "epoch": self.epoch}

    def replay(self, state: Dict[str, Any]) -> None:
        """Draw the order of ``state`` (``state()`` of the run that saved it) again, leaving torch's RNG as it is."""
        rng = torch.frombuffer(bytearray(base64.b64decode(state["rng"])), dtype=torch.uint8)
        epoch = state["epoch"]
        if epoch is not None and hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(rng)
            self.draws = int(state["draws_before"])
            self.draw(epoch)

    def __iter__(self) -> Iterator[int]:
        if self.order is None:
            self.draw()
        return iter(self.order)  # type: ignore[arg-type]

    def __len__(self) -> int:
        return len(self.sampler)


def epoch_draw(loader: Any) -> Optional[EpochDraw]:
    """The ``EpochDraw`` of an odb loader built by ``trainer_sampler``, if it has one."""
    sampler = getattr(loader, "sampler", None)
    inner = sampler.sampler if isinstance(sampler, BatchShardSampler) else None
    return inner if isinstance(inner, EpochDraw) else None


def replay_order(loader: Any, saved: Dict[str, Any], checkpoint: str, world_size: int) -> None:
    """Before a loader resumes in the middle of an epoch: under ``group_by_length`` draw the interrupted epoch's
    order again from the checkpoint's ``saved`` state (the loader then reads on from where it stopped); refuse a
    resume on another number of ranks under either strategy (their order is dealt by rank, not by stride)."""
    strategy_sampler = getattr(loader, "sampler", None)
    if not isinstance(strategy_sampler, BatchShardSampler):
        return
    if saved["world_size"] != world_size:
        raise ValueError(f"checkpoint {checkpoint} was saved by {saved['world_size']} rank(s) in the middle of an "
                         f"epoch, and odb cannot resume that epoch on {world_size}: under group_by_length and "
                         f"batch_rebalance each rank reads the Trainer's batches dealt by rank, which another number "
                         f"of ranks cannot take over. Fix: resume on {saved['world_size']} rank(s), or pass "
                         f"ignore_data_skip=True to start the interrupted epoch's data afresh.")
    drawn = epoch_draw(loader)
    if drawn is None:
        return
    if saved.get("order") is None:
        raise ValueError(f"checkpoint {checkpoint} holds no group_by_length order (odb_state_rank*.json has no "
                         f"'order'), so odb cannot read on in the epoch it interrupted. Fix: resume from a "
                         f"checkpoint saved with train_sampling_strategy='group_by_length', or pass "
                         f"ignore_data_skip=True to start the interrupted epoch's data afresh.")
    drawn.replay(saved["order"])


def check_strategy(trainer: Any, cfg: Any) -> None:
    """Refuse what would not keep the Trainer's steps under ``group_by_length`` or ``batch_rebalance``: odb
    options that change them (another ``global_batch_size`` than the Trainer's step, a ``composition``), and, on
    several processes, Accelerate settings that deal or draw them otherwise than odb does (``split_batches``,
    ``dispatch_batches``; for group_by_length ``use_seedable_sampler=False``, which gives the sampler a generator
    of Accelerate's).

    Example:
        >>> from types import SimpleNamespace
        >>> args = SimpleNamespace(train_sampling_strategy="group_by_length", per_device_train_batch_size=4,
        ...                        gradient_accumulation_steps=2, world_size=1)
        >>> check_strategy(SimpleNamespace(args=args), SimpleNamespace(global_batch_size=8, composition="sampler"))
    """
    args = trainer.args
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in STRATEGIES:
        return
    step = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size
    if cfg.global_batch_size != step:
        raise ValueError(f"odb got global_batch_size={cfg.global_batch_size!r} with train_sampling_strategy="
                         f"{strategy!r}. Rule: odb keeps that strategy's optimizer steps, the Trainer's {step} samples "
                         f"(per_device_train_batch_size x gradient_accumulation_steps x world size), so it needs "
                         f"them as its global_batch_size. Fix: leave global_batch_size unset, or use "
                         f"train_sampling_strategy='random' for steps of another size.")
    if cfg.composition != "sampler":
        raise ValueError(f"odb got composition={cfg.composition!r} with train_sampling_strategy={strategy!r}. Rule: "
                         f"the strategy already chooses which samples form each optimizer step, and odb keeps its "
                         f"steps. Fix: leave composition unset (\"sampler\"), or use train_sampling_strategy='random' "
                         f"to let composition={cfg.composition!r} choose the steps.")
    if args.world_size <= 1:
        return  # Accelerate leaves a single process's loader as it is
    accelerator = trainer.accelerator
    unusual = [f"{name}=True" for name in ("split_batches", "dispatch_batches") if getattr(accelerator, name) is True]
    if strategy == "group_by_length" and accelerator.use_seedable_sampler is False:
        unusual.append("use_seedable_sampler=False")
    if unusual:
        raise ValueError(f"odb got train_sampling_strategy={strategy!r} on {args.world_size} processes with "
                         f"Accelerate's {', '.join(unusual)}. Rule: odb keeps the strategy's optimizer steps as "
                         f"Accelerate deals and draws them by default (whole batches to the ranks in turn, the "
                         f"sampler on torch's RNG), and these settings split, dispatch or draw them otherwise. Fix: "
                         f"leave them at their defaults in TrainingArguments(accelerator_config=...), or use "
                         f"train_sampling_strategy='random'.")


def trainer_sampler(trainer: Any, dataset: Any) -> Tuple[Optional[Sampler], Optional[torch.Generator]]:
    """This rank's share of the Trainer's own order under ``group_by_length`` or ``batch_rebalance`` (see the
    module docstring) and the generator odb's loader then draws its base seeds from (None: torch's global RNG,
    as the Trainer's); (None, None) for other strategies and for a dataset without a length (the Trainer
    ignores the strategy then, and so does odb)."""
    from transformers.trainer_pt_utils import BatchRebalanceSampler

    args = trainer.args
    strategy = getattr(args, "train_sampling_strategy", "random")
    if strategy not in STRATEGIES:
        return None, None
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        logger.warning("odb: train_sampling_strategy=%r is ignored for a training dataset without a length (%s), "
                       "as the Trainer ignores it: samples come in the dataset's own order.", strategy,
                       type(dataset).__name__)
        return None, None
    sampler = trainer._get_train_sampler(dataset)
    if sampler is None:
        return None, None
    generator = None
    rebalance = isinstance(sampler, BatchRebalanceSampler)
    if rebalance:  # seeded by (seed, epoch): no global RNG
        logger.warning("odb: train_sampling_strategy='batch_rebalance' keeps BatchRebalanceSampler's optimizer "
                       "steps (the same %d samples in each) and replaces its rebalance: odb's global plan cuts each "
                       "step's samples into micro-batches under token_budget across the %d rank(s).",
                       sampler.effective_batch_size, args.world_size)
        sampler = RebalanceSteps(sampler)
    else:
        workers = args.dataloader_num_workers
        sampler = EpochDraw(sampler, base_seed_once=bool(args.dataloader_persistent_workers and workers > 0))
        generator = private_generator(args.seed)
    # Accelerate wraps the Trainer's batches only on several processes, and leaves BatchRebalanceSampler's unwrapped
    even = args.world_size > 1 and bool(trainer.accelerator.even_batches) and not rebalance
    # replayable: RebalanceSteps is seeded by epoch, EpochDraw replays from the checkpoint (ODBTrainerMixin)
    return BatchShardSampler(sampler, batch_size=args.per_device_train_batch_size, num_replicas=args.world_size,
                             rank=args.process_index, drop_last=args.dataloader_drop_last, even_batches=even,
                             replayable=True), generator


def private_generator(seed: int) -> torch.Generator:
    """The generator odb's inner loaders draw their workers' base seeds from under ``EpochDraw`` (the global RNG
    is the Trainer's order's and the model's alone)."""
    return torch.Generator().manual_seed(int(seed))
