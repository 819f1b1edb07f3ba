"""Convergence at the user's settings: time to a held-out loss, every arm at the same samples per optimizer step.

Real text (``text_data``), 2 gloo DDP ranks, one memory cap (padded tokens per micro-batch). The
user's settings are a micro-batch B (the largest whose worst case fits the cap, as a user who must not
run out of memory picks it) and an accumulation A; an optimizer step then holds G = B x A x ranks
samples. Every arm below trains with G samples per optimizer step (TRL packing as near as its rows
allow), the same AdamW learning rate (constant: the same schedule for all), from the same initial
weights, with the loss of a step the token mean over all its micro-batches on all ranks (HF's
``num_items_in_batch`` rule; odb's ``loss_scale`` gives it):

- ``fixed``: ``DataLoader(batch_size=B)`` over a ``DistributedSampler``, A micro-batches per step;
- ``group_by_length``: as Trainer 5.23 builds it under DDP: ``LengthGroupedSampler(B x A)`` over the
  whole dataset (the same order on every rank), batches of B dealt to the ranks in turn (accelerate's
  sharding), A per step; a rank left short at the epoch's end runs a ghost (loss x 0), not a repeat;
- ``batch_rebalance``: transformers' ``BatchRebalanceSampler(effective_batch_size=G)`` at its own largest
  safe micro-batch: the fewest micro-batches per step (``grad_accum``) whose every micro-batch fits the cap;
- ``trl_packing``: ``trl.pack_dataset(strategy="bfd", seq_length=cap)`` rows, one per micro-batch, as many
  rows per step as hold about G samples (a row holds a varying number of samples: G cannot be matched
  exactly), the padding-free collator, ``odb_varlen`` attention; a rank left short runs a ghost;
- ``odb_padded`` / ``odb_packed``: ``ODBDataLoader(token_budget=cap, global_batch_size=G)`` over the
  same ``DistributedSampler`` as fixed: step k holds exactly fixed's samples of step k, split into as
  many micro-batches under the cap as they need, planned across both ranks (the default ``step_plan``);
- ``odb_padded_rank``: odb padded with ``step_plan="rank"``: each rank cuts its own share of the step
  (the same samples per step; the plan before the global one, to set the default against);
- ``odb_budget_filled``: today's default without ``global_batch_size``: ``gradient_accumulation_steps=A``
  micro-batches filled to the cap per step: several times G samples per update (fewer, larger
  updates) at the same learning rate; a separate row, not the same updates.

Three interleaved rounds (seeds 0, 1, 2: shuffle and initial weights; the arms take turns epoch by
epoch, their order rotated each round). Each arm trains ``epochs`` epochs; the target is the fixed
arm's final held-out loss in that round; an arm that has not reached it trains up to
``extra_epochs`` more. Reported per arm (medians over rounds, min-max spread): time to the target,
held-out loss at equal time (the shortest arm's training time), the loss at each evaluated optimizer
step, real tokens/s, optimizer steps, micro-steps and samples per step, and what a step costs (padding
share, micro-steps, rank 0's seconds waiting on the loader).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import sys
import time
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch.utils.data import DataLoader, DistributedSampler

import odb

from odb.bench.convergence_labels import LABELS
from odb.bench.verdict import paired_spread, straddles
from odb.plan.steps.composition import adjacent_correlation
from odb.bench.text_data import PAD_ID, TextSamples, held_out_batch, pad_collate, workload_lengths
from odb.bench.training_arms import PACKED_ATTN, fixed_batch_size, trl_rows
from odb.bench.training_run import _autocast, _counts, _reduce, build_model, wrap

ARMS = ("fixed", "group_by_length", "batch_rebalance", "trl_packing", "odb_padded", "odb_packed",
        "odb_budget_filled", "odb_padded_rank", "odb_gbl_padded", "odb_gbl_packed", "odb_length_grouped",
        "odb_length_grouped_packed")
SAME_UPDATES = ("fixed", "group_by_length", "batch_rebalance", "odb_padded", "odb_packed",
                "odb_padded_rank", "odb_gbl_padded", "odb_gbl_packed", "odb_length_grouped",
                "odb_length_grouped_packed")  # exactly G per step
ODB = ("odb_padded", "odb_packed", "odb_budget_filled", "odb_padded_rank", "odb_gbl_padded", "odb_gbl_packed",
       "odb_length_grouped", "odb_length_grouped_packed")
PACKED = ("odb_packed", "odb_gbl_packed", "odb_length_grouped_packed")
ATTENTION = {"trl_packing": PACKED_ATTN, **{a: PACKED_ATTN for a in PACKED}}
# The arm whose steps an arm holds, checked in every round (batch_digest): odb on group_by_length's steps holds
# group_by_length's; the other same-update arms fixed's, except the compositions that choose their own.
REFERENCE = {"odb_gbl_padded": "group_by_length", "odb_gbl_packed": "group_by_length"}
OWN_STEPS = ("odb_length_grouped", "odb_length_grouped_packed", "group_by_length")

FLOAT_TOLERANCE = 1e-4  # of the loss-per-step comparison, beside the rounds' spread: float32 sums in another order
Micro = Dict[str, Any]  # {"batch", "scale" (None: from the step's token count), "samples", "ghost"}
_DIGEST_WEIGHTS = torch.as_tensor(np.random.default_rng(20261128).integers(1, 1 << 20, size=1 << 14))  # per position


def batch_digest(batch: Dict[str, Any]) -> int:
    """The sum over a batch's real tokens of (token + 1) x a fixed random weight of its position in its sample.

    Sums over the micro-batches of a step (and its ranks) are equal when two steps hold the same samples, in
    whatever order, rows or layout (padded rows, or packed rows with restarting ``position_ids``); steps with
    different samples differ but with negligible chance. Exact in float64 (below 2**53) for steps of up to
    2**16 tokens of ids below 2**8 (this section's bytes).

    Example:
        >>> ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
        >>> padded = {"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]])}
        >>> packed = {"input_ids": torch.tensor([[8, 9, 5, 6, 7]]), "position_ids": torch.tensor([[0, 1, 0, 1, 2]])}
        >>> batch_digest(padded) == batch_digest(packed)
        True
    """
    ids = batch["input_ids"]
    if "position_ids" in batch:
        real, pos = torch.ones_like(ids, dtype=torch.bool), batch["position_ids"]
    else:
        mask = batch.get("attention_mask", torch.ones_like(ids)).bool()
        real, pos = mask, mask.long().cumsum(-1) - 1
    weights = _DIGEST_WEIGHTS[pos[real].clamp(min=0)]
    return int(((ids[real].long() + 1) * weights).sum())


def lr_for(base_lr: float, tokens_per_step: float, base_tokens_per_step: float, rule: str = "sqrt") -> float:
    """The learning rate for steps of ``tokens_per_step`` given ``base_lr`` at ``base_tokens_per_step``.

    (No longer applied by the benchmark: every arm at the same samples per step takes the same learning
    rate; kept for comparisons that change the batch.)

    Example:
        >>> lr_for(1e-3, 4000, 1000), lr_for(1e-3, 4000, 1000, rule="none")
        (0.002, 0.001)
    """
    if rule not in ("sqrt", "linear", "none"):
        raise ValueError(f"lr_for: rule={rule!r} is not one of 'sqrt', 'linear', 'none'.")
    ratio = tokens_per_step / base_tokens_per_step
    return base_lr * {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[rule]


def time_to_loss(curve: Sequence[Tuple[float, float]], target: float) -> Optional[float]:
    """Seconds at which a (seconds, loss) curve first reaches ``target`` (linear between points), or None.

    Example:
        >>> time_to_loss([(0.0, 5.0), (10.0, 3.0), (20.0, 2.0)], 4.0)
        5.0
    """
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t0 if l0 <= target else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return curve[0][0] if curve and curve[0][1] <= target else None


def loss_at(curve: Sequence[Tuple[float, float]], t: float) -> Optional[float]:
    """A (seconds, loss) curve's loss at ``t`` (linear between points), or None past its end.

    Example:
        >>> loss_at([(0.0, 5.0), (10.0, 3.0)], 5.0), loss_at([(0.0, 5.0)], 1.0)
        (4.0, None)
    """
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= t <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (t - t0) / (t1 - t0)
    return curve[-1][1] if curve and abs(curve[-1][0] - t) < 1e-9 else None


def spread(values: Sequence[Optional[float]]) -> Optional[Dict[str, float]]:
    """Median, min and max of the values that exist (None if any is missing: a run that did not get there)."""
    if not values or any(v is None for v in values):
        return None
    vals = [float(v) for v in values]  # type: ignore[arg-type]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def _chunks(items: List[Any], n: int) -> List[List[Any]]:
    return [items[i:i + n] for i in range(0, len(items), n)]


def _label_tokens(batch: Dict[str, Any]) -> int:
    """The tokens a causal LM's mean loss divides by: labels after the shift that are not -100."""
    return int((batch["labels"][..., 1:] != -100).sum())


def _equalize(dealt: List[List[List[Any]]], rank: int) -> List[List[Any]]:
    """This rank's steps, each padded with None (a ghost micro-batch) to the most micro-batches any rank has in
    that step, and as many steps as the rank with the most: DDP needs the same forwards on every rank.

    Example:
        >>> _equalize([[[1, 2], [3]], [[4, 5]]], 1)
        [[4, 5], [None]]
    """
    longest = max(len(d) for d in dealt)
    out = []
    for k in range(longest):
        want = max(len(d[k]) if k < len(d) else 0 for d in dealt)
        mine = list(dealt[rank][k]) if k < len(dealt[rank]) else []
        out.append(mine + [None] * (want - len(mine)))
    return out


class _LengthGroupedOrder:
    """group_by_length's order of an epoch (``LengthGroupedSampler(megabatch_samples)`` seeded as the
    group_by_length arm seeds it), for ``odb.BatchShardSampler`` to deal."""

    def __init__(self, lengths: List[int], megabatch_samples: int, seed: int) -> None:
        self.lengths, self.size, self.seed, self.epoch = lengths, megabatch_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[int]:
        from transformers.trainer_pt_utils import LengthGroupedSampler

        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return iter(list(LengthGroupedSampler(self.size, lengths=self.lengths, generator=g)))


class _Arm:
    """One arm's loader and its optimizer steps on this rank: a list of micro-batches per step."""

    def __init__(self, arm: str, dataset: TextSamples, cap: int, b: int, acc: int, rank: int, world: int,
                 seed: int, rows: Any, micro_batch_cost: Optional[float] = None) -> None:
        self.arm, self.dataset, self.cap, self.b, self.acc = arm, dataset, cap, b, acc
        self.rank, self.world, self.seed = rank, world, seed
        self.g = b * acc * world  # samples per optimizer step, all ranks
        self.lengths: List[int] = dataset.lengths.tolist()
        self.wait = 0.0  # seconds in next(loader) this epoch (rank 0's is reported)
        self.settings = ""
        if arm in ("fixed",) + ODB:
            self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        if arm in ("odb_gbl_padded", "odb_gbl_packed"):  # group_by_length's order, dealt as accelerate deals it
            self.sampler = odb.BatchShardSampler(_LengthGroupedOrder(self.lengths, b * acc, seed), b, world, rank)
        if arm == "fixed":
            self.loader: Any = DataLoader(dataset, batch_size=b, sampler=self.sampler, collate_fn=pad_collate)
            self.settings = f"DataLoader(batch_size={b}), DistributedSampler, {acc} micro-batches per step"
        elif arm == "group_by_length":
            self.settings = (f"LengthGroupedSampler({b}x{acc}) on every rank, batches of {b} dealt to the ranks in "
                             f"turn (Trainer 5.23 + accelerate), {acc} per step; ghost where a rank is short")
        elif arm == "batch_rebalance":
            self.rebalance_accum = self._rebalance_accum()
            self.settings = (f"BatchRebalanceSampler(effective_batch_size={self.g}, grad_accum="
                             f"{self.rebalance_accum}): the fewest micro-batches per step that fit the cap")
        elif arm == "trl_packing":
            self.rows = rows
            per_row = len(dataset) / len(rows)
            self.rows_per_rank = max(1, round(self.g / (per_row * world)))
            self.settings = (f"trl.pack_dataset(bfd, seq_length={cap}): {len(rows)} rows of {per_row:.1f} samples on "
                             f"average; {self.rows_per_rank} row(s) per rank per step = about "
                             f"{self.rows_per_rank * world * per_row:.0f} samples per step (G = {self.g} cannot be "
                             f"matched: a row holds a varying number of samples); odb_varlen attention")
            from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

            self.trl_collate = DataCollatorForLanguageModeling(pad_token_id=PAD_ID, padding_free=True)
        elif arm in ODB:
            options: Dict[str, Any] = {"shift_labels": True}
            options.update({"layout": "packed"} if arm in PACKED else {"collate_fn": pad_collate})
            if arm == "odb_budget_filled":
                options["gradient_accumulation_steps"] = acc
                self.settings = (f"ODBDataLoader(token_budget={cap}, gradient_accumulation_steps={acc}): today's "
                                 "budget-filled steps (more samples per update), same learning rate")
            else:
                options["global_batch_size"] = self.g
                if arm == "odb_padded_rank":
                    options["step_plan"] = "rank"
                if arm.startswith("odb_length_grouped"):
                    options["composition"] = "length_grouped"
                if micro_batch_cost is not None:  # benchmarks/convergence_cut_price.py: the cut's price varied
                    options["micro_batch_cost"] = micro_batch_cost
                self.settings = (f"ODBDataLoader(token_budget={cap}, global_batch_size={self.g}"
                                 + (", step_plan='rank'" if arm == "odb_padded_rank" else "")
                                 + (", composition='length_grouped'" if arm.startswith("odb_length_grouped") else "")
                                 + (f", micro_batch_cost={micro_batch_cost}" if micro_batch_cost is not None else "")
                                 + (", layout='packed'), odb_varlen" if arm in PACKED else ")")
                                 + (", BatchShardSampler(group_by_length's LengthGroupedSampler)"
                                    if arm.startswith("odb_gbl") else ", the DistributedSampler of fixed"))
            self.loader = odb.ODBDataLoader(dataset, token_budget=cap, sampler=self.sampler, seed=seed, **options)
        else:
            raise ValueError(f"unknown convergence arm {arm!r}; known: {', '.join(ARMS)}")

    def _rebalance(self, accum: int, rank: int) -> Any:
        from transformers.trainer_pt_utils import BatchRebalanceSampler

        return BatchRebalanceSampler(lengths=self.lengths, effective_batch_size=self.g, dp_size=self.world,
                                     grad_accum=accum, rank=rank, seed=self.seed, drop_last=False)

    def _rebalance_accum(self) -> int:
        """The fewest micro-batches per step whose every micro-batch (B_i x its longest) fits the cap, every rank."""
        lengths = np.asarray(self.lengths)
        for accum in range(1, self.g // self.world + 1):
            if all(len(bt) * int(lengths[bt].max()) <= self.cap for r in range(self.world)
                   for bt in self._rebalance(accum, r)):
                return accum
        return self.g // self.world

    def _timed(self, it: Iterator[Any]) -> Iterator[Any]:
        while True:
            t = time.perf_counter()
            x = next(it, None)
            self.wait += time.perf_counter() - t
            if x is None:
                return
            yield x

    def _padded(self, batch_lists: List[List[int]]) -> Iterator[Micro]:
        loader = DataLoader(self.dataset, batch_sampler=batch_lists, collate_fn=pad_collate)
        for batch in self._timed(iter(loader)):
            yield {"batch": batch, "scale": None, "samples": int(batch["input_ids"].shape[0]), "ghost": False}

    def steps(self, epoch: int) -> Iterator[List[Micro]]:
        """This rank's optimizer steps of ``epoch``; an empty list: a step where this rank has no sample."""
        self.wait = 0.0
        arm, acc, world, rank = self.arm, self.acc, self.world, self.rank
        if arm == "fixed":
            self.sampler.set_epoch(epoch)
            step: List[Micro] = []
            for batch in self._timed(iter(self.loader)):
                step.append({"batch": batch, "scale": None, "samples": int(batch["input_ids"].shape[0]),
                             "ghost": False})
                if len(step) == acc:
                    yield step
                    step = []
            if step:
                yield step
        elif arm == "group_by_length":
            from transformers.trainer_pt_utils import LengthGroupedSampler

            g = torch.Generator().manual_seed(self.seed * 1000 + epoch)
            order = list(LengthGroupedSampler(self.b * acc, lengths=self.lengths, generator=g))
            dealt = [_chunks(_chunks(order, self.b)[r::world], acc) for r in range(world)]
            yield from self._group(_equalize(dealt, rank))
        elif arm == "batch_rebalance":
            sampler = self._rebalance(self.rebalance_accum, rank)
            sampler.set_epoch(epoch)
            yield from self._group(_chunks(list(sampler), self.rebalance_accum))
        elif arm == "trl_packing":
            perm = torch.randperm(len(self.rows), generator=torch.Generator().manual_seed(self.seed * 1000 + epoch))
            dealt = [_chunks(perm[r::world].tolist(), self.rows_per_rank) for r in range(world)]
            for ids in _equalize(dealt, rank):
                step = []
                for i in ids:
                    if i is None:
                        step.append(self.ghost())
                        continue
                    t = time.perf_counter()
                    batch = self.trl_collate([self.rows[int(i)]])
                    self.wait += time.perf_counter() - t
                    step.append({"batch": batch, "scale": None, "samples": int((batch["position_ids"] == 0).sum()),
                                 "ghost": False})
                yield step
        else:
            self.loader.set_epoch(epoch)
            step = []
            for batch in self._timed(iter(self.loader)):
                info = odb.pop_step_info(batch)
                step.append({"batch": batch, "scale": info.loss_scale, "samples": info.local_samples,
                             "ghost": info.is_ghost})
                if info.is_last_micro_step:
                    yield step
                    step = []
            if step:
                yield step

    def _group(self, steps: List[List[List[int]]]) -> Iterator[List[Micro]]:
        """Load each step's micro-batches (lists of indices) through one DataLoader."""
        flat = [b for s in steps for b in s if b is not None]
        loaded = self._padded(flat)
        for s in steps:
            yield [self.ghost() if b is None else next(loaded) for b in s]

    def ghost(self) -> Micro:
        """A micro-batch that only keeps DDP's collectives aligned: trained with loss x 0."""
        if self.arm == "trl_packing":
            batch = self.trl_collate([self.rows[0]])
        else:
            batch = pad_collate([self.dataset[0]])
        return {"batch": batch, "scale": 0.0, "samples": 0, "ghost": True}


class _Run:
    """One arm in one round: model, optimizer, loss curve; trained an epoch at a time."""

    def __init__(self, arm: str, loaders: _Arm, lr: float, world: int, device: torch.device, held: Dict[str, Any],
                 every: int, seed: int, max_len: int) -> None:
        self.arm, self.loaders, self.world, self.device, self.held, self.every = arm, loaders, world, device, held, every
        self.model = wrap(build_model(device, max_len, ATTENTION.get(arm, "sdpa"), seed=seed), world)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        self.curve: List[Tuple[float, int, float]] = [(0.0, 0, self._evaluate())]
        self.train_s, self.steps, self.epochs = 0.0, 0, 0
        self.micro = self.samples = self.real = self.padded = 0
        self.wait_s = 0.0
        self.at_epochs: Dict[str, Any] = {}
        self.digests: List[int] = []  # per optimizer step: batch_digest summed over its micro-batches and ranks
        self.step_tokens: List[Tuple[float, float]] = []  # per optimizer step: (real tokens, samples), all ranks

    def _evaluate(self) -> float:
        module = getattr(self.model, "module", self.model)
        with torch.no_grad(), _autocast(self.device)():
            return float(module(**self.held).loss)

    def _step(self, micro: List[Micro]) -> None:
        if not micro:
            micro = [self.loaders.ghost()]
        if self.arm not in ODB:  # the step's token mean over every rank: HF's num_items_in_batch
            counts = [0 if m["ghost"] else _label_tokens(m["batch"]) for m in micro]
            total = _reduce([float(sum(counts))], "SUM", self.world)[0]
            scales = [c / total * self.world for c in counts]  # DDP averages the gradients over the ranks
        else:
            scales = [m["scale"] for m in micro]
        for i, (m, scale) in enumerate(zip(micro, scales)):
            batch = {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in m["batch"].items()}
            sync = self.world <= 1 or i == len(micro) - 1
            with (contextlib.nullcontext() if sync else self.model.no_sync()), _autocast(self.device)():
                loss = self.model(**batch).loss
            (loss * scale).backward()
            if not m["ghost"]:
                r, p = _counts(m["batch"])
                self.real, self.padded, self.samples = self.real + r, self.padded + p, self.samples + m["samples"]
        self.micro += len(micro)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def epoch(self, epoch: int) -> None:
        if self.world > 1:
            torch.distributed.barrier()
        start, paused, first = time.perf_counter(), 0.0, len(self.digests)
        for micro in self.loaders.steps(epoch):
            t = time.perf_counter()  # what the step holds, for the check against fixed's steps: off the clock
            self.digests.append(sum(batch_digest(m["batch"]) for m in micro if not m["ghost"]))
            self.step_tokens.append((float(sum(_counts(m["batch"])[0] for m in micro if not m["ghost"])),
                                     float(sum(m["samples"] for m in micro if not m["ghost"]))))
            paused += time.perf_counter() - t
            self._step(micro)
            self.steps += 1
            if self.steps % self.every == 0:
                t = time.perf_counter()
                self.curve.append((self.train_s + t - start - paused, self.steps, self._evaluate()))
                paused += time.perf_counter() - t
        if self.world > 1:
            torch.distributed.barrier()
        wall = _reduce([time.perf_counter() - start - paused], "MAX", self.world)[0]  # the slowest rank's
        self.digests[first:] = [int(d) for d in _reduce([float(d) for d in self.digests[first:]], "SUM", self.world)]
        flat = _reduce([v for pair in self.step_tokens[first:] for v in pair], "SUM", self.world)
        self.step_tokens[first:] = list(zip(flat[0::2], flat[1::2]))
        self.train_s, self.epochs = self.train_s + wall, self.epochs + 1
        self.wait_s += self.loaders.wait
        if self.curve[-1][1] != self.steps:
            self.curve.append((self.train_s, self.steps, self._evaluate()))
        else:  # evaluated at the epoch's last step: that point is at the epoch's end (the slowest rank's clock)
            self.curve[-1] = (self.train_s, self.steps, self.curve[-1][2])

    def snapshot(self) -> None:
        """The figures after the common epochs (before any extra epoch toward the target)."""
        real, padded, samples = _reduce([float(self.real), float(self.padded), float(self.samples)], "SUM",
                                        self.world)
        self.at_epochs = {"train_s": self.train_s, "steps": self.steps, "micro_steps": self.micro,
                          "final_loss": self.curve[-1][2], "real_tokens": int(real), "padded_tokens": int(padded),
                          "samples": int(samples), "loader_wait_s": self.wait_s,
                          "tokens_per_s": real / self.train_s if self.train_s > 0 else float("nan")}


def _round(arms: Sequence[str], dataset: TextSamples, rows: Any, params: Dict[str, Any], acc: int, seed: int,
           rank: int, world: int, device: torch.device, held: Dict[str, Any], log: Any) -> Dict[str, Any]:
    cap, epochs, b = int(params["cap"]), int(params["epochs"]), fixed_batch_size(int(params["cap"]), dataset.lengths)
    steps_per_epoch = math.ceil(len(dataset) / (b * acc * world))
    every = max(1, round(steps_per_epoch * epochs / int(params["evals"])))
    max_len = max(int(dataset.lengths.max()), 16)
    cost = params.get("micro_batch_cost")  # None: odb's default (benchmarks/convergence_cut_price.py varies it)
    runs = {a: _Run(a, _Arm(a, dataset, cap, b, acc, rank, world, seed, rows, cost), float(params["base_lr"]), world,
                    device, held, every, seed, max_len) for a in arms}
    names = list(runs)
    for epoch in range(epochs):  # the arms take turns epoch by epoch, their order rotated each round and epoch
        k = (seed + epoch) % len(names)
        for a in names[k:] + names[:k]:
            runs[a].epoch(epoch)
    for run in runs.values():
        run.snapshot()
    target = runs["fixed"].curve[-1][2] if "fixed" in runs else max(r.curve[-1][2] for r in runs.values())
    for extra in range(int(params.get("extra_epochs", 1))):
        behind = [a for a in names if time_to_loss([(s, v) for s, _, v in runs[a].curve], target) is None]
        for a in behind:
            runs[a].epoch(epochs + extra)
    equal_s = min(r.at_epochs["train_s"] for r in runs.values())
    out: Dict[str, Any] = {"seed": seed, "target_loss": target, "equal_time_s": equal_s, "eval_every_steps": every,
                           "arms": {}}
    for a, run in runs.items():
        curve = [(s, v) for s, _, v in run.curve]
        out["arms"][a] = {**run.at_epochs, "settings": run.loaders.settings,
                          "time_to_target_s": time_to_loss(curve, target), "loss_at_equal_time": loss_at(curve,
                                                                                                       equal_s),
                          "epochs_trained": run.epochs,
                          "target_step": time_to_loss([(k, v) for _, k, v in run.curve], target),
                          "curve": [{"s": s, "step": k, "loss": v} for s, k, v in run.curve]}
        means = [t / n for t, n in run.step_tokens[:run.at_epochs["steps"]] if n]
        out["arms"][a]["adjacent_correlation"] = adjacent_correlation(means)
        ref_name = REFERENCE.get(a, "fixed")
        ref = runs.get(ref_name)
        if ref is not None:  # does every step hold its reference's samples? Then it is read at the reference's step
            same = sum(x == y for x, y in zip(run.digests, ref.digests))
            as_ref = same == len(ref.digests) <= len(run.digests)
            ref_step = time_to_loss([(k, v) for _, k, v in ref.curve], target)
            out["arms"][a].update({
                "reference": ref_name, "steps_as_reference": same, "steps_compared": len(ref.digests),
                "same_samples_as_reference": as_ref, "same_samples_as_fixed": as_ref and ref_name == "fixed",
                "steps_as_fixed": same if ref_name == "fixed" else 0,
                "time_at_target_step_s": (loss_at([(k, s) for s, k, _ in run.curve], ref_step)
                                          if as_ref and ref_step is not None else None)})
        if rank == 0:
            m = out["arms"][a]
            t = m["time_to_target_s"]
            log(f"[convergence A={acc} seed {seed}] {a}: {m['steps']} steps, {m['micro_steps']} micro-steps, "
                f"{m['train_s']:.1f} s, loss {m['curve'][0]['loss']:.3f} -> {m['final_loss']:.3f}, to "
                f"{target:.3f}: {'not reached' if t is None else f'{t:.1f} s'}")
    return out


def read_time(arm_round: Dict[str, Any]) -> Optional[float]:
    """The time to the target that the ratios and goals read for one arm in one round.

    For an arm whose every optimizer step held fixed's samples (checked in the run by ``batch_digest``),
    its time at the optimizer step where fixed reached the target: its updates are fixed's, so its loss curve
    differs from fixed's only by rounding (float32 sums in another order, which the training then amplifies), and
    that noise should not decide a comparison of speeds. Any other arm: the time its own curve reaches the target.

    Example:
        >>> read_time({"time_to_target_s": 9.0, "same_samples_as_fixed": True, "time_at_target_step_s": 8.0})
        8.0
        >>> read_time({"time_to_target_s": 9.0, "same_samples_as_fixed": False, "time_at_target_step_s": None})
        9.0
    """
    if arm_round.get("same_samples_as_reference", arm_round.get("same_samples_as_fixed")):
        return arm_round.get("time_at_target_step_s")
    return arm_round.get("time_to_target_s")


def summarize(rounds: List[Dict[str, Any]], world: int) -> Dict[str, Any]:
    """Medians and spreads over rounds of every arm's figures; the loss at each evaluated step."""
    arms = list(rounds[0]["arms"])
    out: Dict[str, Any] = {"target_loss": spread([r["target_loss"] for r in rounds]),
                           "equal_time_s": spread([r["equal_time_s"] for r in rounds]), "arms": {}}
    for a in arms:
        per = [r["arms"][a] for r in rounds]
        first = per[0]
        steps = first["steps"]
        loss_by_step: Dict[int, List[float]] = {}
        for p in per:
            for point in p["curve"]:
                loss_by_step.setdefault(point["step"], []).append(point["loss"])
        out["arms"][a] = {
            "settings": first["settings"],
            "time_to_target_s": spread([p["time_to_target_s"] for p in per]),
            "reached": sum(p["time_to_target_s"] is not None for p in per),
            "same_samples_as_fixed": all(p.get("same_samples_as_fixed") for p in per),
            "reference": first.get("reference"),
            "same_samples_as_reference": all(p.get("same_samples_as_reference") for p in per),
            "adjacent_correlation": spread([p.get("adjacent_correlation") for p in per]),
            "steps_as_fixed": sum(p.get("steps_as_fixed", 0) for p in per),
            "steps_compared": sum(p.get("steps_compared", 0) for p in per),
            "time_read_s": spread([read_time(p) for p in per]),
            "target_step": spread([p.get("target_step") for p in per]),
            "loss_at_equal_time": spread([p["loss_at_equal_time"] for p in per]),
            "final_loss": spread([p["final_loss"] for p in per]), "train_s": spread([p["train_s"] for p in per]),
            "tokens_per_s": spread([p["tokens_per_s"] for p in per]),
            "loader_wait_s": spread([p["loader_wait_s"] for p in per]),
            "steps": steps, "micro_steps_per_step": first["micro_steps"] / max(1, steps),
            "samples_per_step": first["samples"] / max(1, steps),
            "padding_share": 1.0 - first["real_tokens"] / max(1, first["padded_tokens"]),
            "real_tokens": first["real_tokens"],
            "ms_per_micro_step": statistics.median(p["train_s"] / max(1, p["micro_steps"]) for p in per) * 1e3,
            "loss_by_step": [{"step": k, **(spread(v) or {})} for k, v in sorted(loss_by_step.items())
                             if len(v) == len(per)],
        }
    fixed = out["arms"].get("fixed", {}).get("time_read_s")
    gbl = out["arms"].get("group_by_length", {}).get("time_read_s")
    for a, m in out["arms"].items():
        t = m["time_read_s"]
        m["time_vs_fixed"] = t["median"] / fixed["median"] if t and fixed and fixed["median"] > 0 else None
        m["time_vs_group_by_length"] = t["median"] / gbl["median"] if t and gbl and gbl["median"] > 0 else None
    return out


def curve_gap(conv_acc: Dict[str, Any], arm: str, ref: str = "fixed") -> Optional[Dict[str, float]]:
    """The largest |median loss of ``arm`` - median loss of ``ref``| over the evaluated steps both have, beside the
    rounds' spread of ``ref`` (max - min) at that step; None where they share no evaluated step."""
    a = {p["step"]: p for p in conv_acc["arms"][arm]["loss_by_step"]}
    r = {p["step"]: p for p in conv_acc["arms"][ref]["loss_by_step"]}
    common = sorted(set(a) & set(r) - {0})
    if not common:
        return None
    gaps = [(abs(a[k]["median"] - r[k]["median"]), r[k]["max"] - r[k]["min"], k) for k in common]
    worst = max(gaps, key=lambda g: g[0] - g[1])
    return {"max_gap": max(g[0] for g in gaps), "worst_gap": worst[0], "spread_there": worst[1],
            "step": worst[2], "within": all(g[0] <= g[1] + FLOAT_TOLERANCE for g in gaps),
            "steps_compared": len(common), "tolerance": FLOAT_TOLERANCE}


def run_convergence(rank: int, world: int, params: Dict[str, Any]) -> Dict[str, Any]:
    """Every accumulation of ``params["accumulations"]``, ``rounds`` rounds of every arm; rank 0's view."""
    device = torch.device(params.get("device", "cpu"))
    cap = int(params["cap"])
    lengths = workload_lengths(params["workload"], int(params["samples"]))
    dataset = TextSamples(lengths)
    arms = tuple(params.get("arms", ARMS))
    rows = trl_rows(dataset, cap) if "trl_packing" in arms else None
    held = {k: v.to(device) for k, v in held_out_batch().items()}
    b = fixed_batch_size(cap, lengths)

    def log(msg: str) -> None:
        if rank == 0:
            print(msg, file=sys.stderr, flush=True)

    out: Dict[str, Any] = {"workload": params["workload"], "samples": len(dataset), "world": world, "cap": cap,
                           "fixed_batch_size": b, "base_lr": float(params["base_lr"]), "lr_schedule": "constant",
                           "epochs": int(params["epochs"]), "extra_epochs": int(params.get("extra_epochs", 1)),
                           "rounds": int(params["rounds"]), "mean_length": float(lengths.mean()),
                           "max_length": int(lengths.max()), "tokens": int(lengths.sum()),
                           "held_out": {"samples": int(held["input_ids"].shape[0]),
                                        "length": int(held["input_ids"].shape[1])},
                           "accumulations": {}}
    for acc in params["accumulations"]:
        rounds = [_round(arms, dataset, rows, params, int(acc), seed, rank, world, device, held, log)
                  for seed in range(int(params["rounds"]))]
        summary = summarize(rounds, world)
        summary.update({"accumulation": int(acc), "global_batch_size": b * int(acc) * world, "rounds": rounds})
        out["accumulations"][str(acc)] = summary
    return out


def convergence_goals(conv: Dict[str, Any], acc: str = "8", plans_only: bool = False) -> List[Dict[str, Any]]:
    """The goals (2 ranks, at accumulation ``acc``): time to the target against fixed, group_by_length and the
    per-rank plan (odb_padded_rank: each rank cuts its own share), and the curve's match. ``plans_only``: the
    goals of the default step plan alone (against group_by_length and the per-rank plan) and the compositions'."""
    part = conv.get("accumulations", {}).get(acc)
    if not part:
        return []
    arms = part["arms"]
    out: List[Dict[str, Any]] = []

    def ttt(a: str, key: str = "time_read_s") -> Optional[float]:
        t = arms.get(a, {}).get(key)
        return None if t is None else t["median"]

    def ratio_goal(name: str, arm: str, base: str, target: float, context: Sequence[str] = ()) -> None:
        if arm not in arms or base not in arms:
            return
        a, b = ttt(arm), ttt(base)
        ratio = None if a is None or b is None or b <= 0 else a / b
        a_raw, b_raw = ttt(arm, "time_to_target_s"), ttt(base, "time_to_target_s")
        spread = paired_spread((read_time(r["arms"][arm]), read_time(r["arms"][base]))
                               for r in part.get("rounds") or [] if arm in r["arms"] and base in r["arms"])
        out.append({"goal": f"convergence (2 ranks, A = {acc}): time to target, {name}", "measured": ratio,
                    "target": target, "met": ratio is not None and ratio <= target, "lower_is_better": True,
                    "arms": [arm, base], "spread": spread, "straddles": straddles(spread, target),
                    "accumulation": int(acc),
                    "read_at_fixed_step": [x for x in (arm, base) if arms[x].get("same_samples_as_fixed")],
                    "own_curves": None if a_raw is None or b_raw is None or b_raw <= 0 else a_raw / b_raw,
                    "context": [c for c in context if c in arms]})

    if plans_only:
        ratio_goal("odb padded / group_by_length", "odb_padded", "group_by_length", 1.0, context=("odb_packed",))
        ratio_goal("odb packed / group_by_length", "odb_packed", "group_by_length", 1.0)
        ratio_goal("odb padded (global plan) / odb padded, per-rank plan", "odb_padded", "odb_padded_rank", 1.0)
        composition_goals(part, acc, ratio_goal, out)
        return out
    ratio_goal("odb padded / fixed", "odb_padded", "fixed", 0.5)
    ratio_goal("odb padded / group_by_length", "odb_padded", "group_by_length", 1.0)
    ratio_goal("odb packed / group_by_length", "odb_packed", "group_by_length", 0.85)
    ratio_goal("odb padded (global plan) / odb padded, per-rank plan", "odb_padded", "odb_padded_rank", 1.0)
    for arm in ("odb_padded", "odb_packed"):
        if arm in arms and "fixed" in arms:
            gap = curve_gap(part, arm)
            out.append({"goal": f"convergence (2 ranks, A = {acc}): {LABELS[arm]}'s loss per optimizer step = "
                                f"fixed's within the rounds' spread", "measured": None if gap is None else gap["max_gap"],
                        "target": None if gap is None else gap["spread_there"], "met": bool(gap and gap["within"]),
                        "gap": gap, "arms": [arm, "fixed"]})
    composition_goals(part, acc, ratio_goal, out)
    return out


def composition_bound(arms: Dict[str, Any], arm: str, twin: str, base: str, target: float) -> Optional[Dict[str, Any]]:
    """The least time to the target that ``arm``'s steps allow, as a share of ``base``'s: those steps at zero
    padding and one micro-step per rank. Two readings, the lower taken: ``twin``, the packed arm on the same steps
    (measured: no padding, one micro-step), its time to the target against ``base``'s; and a model, ``arm``'s steps
    to the target against ``base``'s times ``base``'s unpadded share (time proportional to padded tokens).
    ``reachable``: the bound is within ``target`` (else no padded cut of these steps meets the goal).

    Example:
        >>> arms = {"a": {"target_step": {"median": 88.0}, "time_read_s": {"median": 7.8}, "padding_share": 0.05},
        ...         "t": {"target_step": {"median": 88.0}, "time_read_s": {"median": 7.5}, "padding_share": 0.0},
        ...         "g": {"target_step": {"median": 77.0}, "time_read_s": {"median": 7.4}, "padding_share": 0.08}}
        >>> b = composition_bound(arms, "a", "t", "g", 1.0)
        >>> round(b["steps_ratio"], 3), round(b["model"], 3), round(b["measured"], 3), round(b["bound"], 3)
        (1.143, 1.051, 1.014, 1.014)
        >>> b["reachable"]
        False
    """
    def median(a: str, key: str) -> Optional[float]:
        value = (arms.get(a, {}).get(key) or {}).get("median")
        return None if value is None else float(value)

    steps, base_steps, base_s = median(arm, "target_step"), median(base, "target_step"), median(base, "time_read_s")
    if not steps or not base_steps or not base_s:
        return None
    model = (1.0 - float(arms[base]["padding_share"])) * steps / base_steps
    twin_s = median(twin, "time_read_s")
    measured = None if twin_s is None else twin_s / base_s
    bound = model if measured is None else min(model, measured)
    return {"steps_ratio": steps / base_steps, "unpadded_share": 1.0 - float(arms[base]["padding_share"]),
            "model": model, "twin": twin if measured is not None else None, "measured": measured, "bound": bound,
            "reachable": bound <= target}


def composition_goals(part: Dict[str, Any], acc: str, ratio_goal: Any, out: List[Dict[str, Any]]) -> None:
    """The step compositions' goals at accumulation ``acc``: odb on group_by_length's steps against
    group_by_length (its time and its loss per step), ``length_grouped`` against group_by_length (time, adjacent
    steps' length correlation), and odb's best arm against the best other arm."""
    arms = part["arms"]
    for name, arm, target, twin, context in (
            ("odb padded on group_by_length's steps", "odb_gbl_padded", 0.95, "odb_gbl_packed", ()),
            ("odb packed on group_by_length's steps", "odb_gbl_packed", 0.9, None, ()),
            ("odb length_grouped", "odb_length_grouped", 1.0, "odb_length_grouped_packed",
             ("odb_length_grouped_packed",))):
        ratio_goal(f"{name} / group_by_length", arm, "group_by_length", target, context=context)
        if twin is not None and out and out[-1]["arms"] == [arm, "group_by_length"]:
            out[-1]["bound"] = composition_bound(arms, arm, twin, "group_by_length", target)
    for arm in ("odb_gbl_padded", "odb_gbl_packed"):
        if arm in arms and "group_by_length" in arms:
            gap = curve_gap(part, arm, "group_by_length")
            out.append({"goal": f"convergence (2 ranks, A = {acc}): {LABELS[arm]}: loss per optimizer step = "
                                f"group_by_length's within the rounds' spread",
                        "measured": None if gap is None else gap["max_gap"],
                        "target": None if gap is None else gap["spread_there"], "met": bool(gap and gap["within"]),
                        "gap": gap, "arms": [arm, "group_by_length"]})
    if "odb_length_grouped" in arms and "group_by_length" in arms:
        mine = (arms["odb_length_grouped"].get("adjacent_correlation") or {}).get("median")
        theirs = (arms["group_by_length"].get("adjacent_correlation") or {}).get("median")
        out.append({"goal": f"convergence (2 ranks, A = {acc}): adjacent steps' mean-length correlation, odb "
                            f"length_grouped (group_by_length: {'-' if theirs is None else f'{theirs:.2f}'})",
                    "measured": mine, "target": 0.2, "met": mine is not None and mine <= 0.2,
                    "lower_is_better": True, "arms": ["odb_length_grouped", "group_by_length"]})
    read = {a: (m.get("time_read_s") or {}).get("median") for a, m in arms.items() if a != "odb_budget_filled"}
    ours = {a: t for a, t in read.items() if a in ODB and t is not None}
    others = {a: t for a, t in read.items() if a not in ODB and t is not None}
    if ours and others:
        best, other = min(ours, key=ours.get), min(others, key=others.get)
        ratio_goal(f"odb's best arm ({LABELS[best]}) / the best other arm ({LABELS[other]})", best, other, 1.0)


CAP = 4096
BASE_LR = 3e-3  # every arm's learning rate (AdamW, constant)
# The full run (10.7 min on 2 cores at commit 9dc16cd, load average 1.5 at its start, published 2026-11-28)
# and the smoke test's (structure only, its figures mean nothing).
SIZES: Dict[str, Dict[str, Any]] = {
    "full": {"workload": "heavy-tailed", "samples": 384, "epochs": 2, "evals": 6, "rounds": 3,
             "accumulations": [1, 8], "extra_epochs": 1},
    "quick": {"workload": "heavy-tailed", "samples": 24, "epochs": 1, "evals": 1, "rounds": 1,
              "accumulations": [1, 8], "extra_epochs": 0},
}


def breakdown(conv: Dict[str, Any], acc: Optional[str] = None) -> Dict[str, Dict[str, Any]]:
    """What a step of each arm costs, measured at accumulation ``acc`` (default A = 8, else the largest A): the
    figures a missed goal is read by."""
    accs = conv.get("accumulations", {})
    if not accs or (acc is not None and acc not in accs):
        return {}
    acc = acc if acc is not None else ("8" if "8" in accs else max(accs, key=int))
    arms = accs[acc]["arms"]
    return {a: {"accumulation": int(acc), "padding_share": m["padding_share"],
                "micro_steps_per_step": m["micro_steps_per_step"], "ms_per_micro_step": m["ms_per_micro_step"],
                "loader_wait_s": (m["loader_wait_s"] or {}).get("median"), "train_s": (m["train_s"] or {}).get("median"),
                "steps": m["steps"], "tokens_per_s": (m["tokens_per_s"] or {}).get("median"),
                "same_samples_as_fixed": m.get("same_samples_as_fixed", False),
                "target_step": ((arms["fixed"] if m.get("same_samples_as_fixed") and "fixed" in arms
                                 else m).get("target_step") or {}).get("median"),
                "time_read_s": (m.get("time_read_s") or {}).get("median")}
            for a, m in arms.items()}
