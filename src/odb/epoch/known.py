"""Known lengths: plan in the batch sampler, so workers fetch and collate whole batches.

When every sample's length is given up front (``lengths=``), odb need not see the
processed samples to group them. The epoch's planning runs as usual (same windows,
planner, rank alignment and resume cursors) over index-only records; its index lists
become the inner DataLoader's ``batch_sampler``, so the workers read and collate each
batch as a plain DataLoader would, and the training thread costs what a plain
DataLoader's does. Supervised tokens are counted in each collated batch; the loss
scale of an optimizer step is fixed once all its micro-batches have arrived (one small
exchange per optimizer step across ranks).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable, Deque, Iterable, Iterator, List, Optional, Sequence, Tuple

import numpy as np
from torch.utils.data import Sampler

from odb.config import ODBConfig
from odb.comm.protocol import announce_in_background
from odb.epoch.cursor import Cursor
from odb.data.declared import Checked, DeclaredLengthCheck
from odb.data.lengths import batch_loss_tokens
from odb.data.source import Record
from odb.data.worker_deaths import WorkerWatch
from odb.epoch.peer_check import batch_digest
from odb.step_info import ODBStepInfo, attach_step_info, loss_scale, pop_step_info

_CHUNK = 256


def known_records(order: Iterable[int], lengths: np.ndarray, skip: int = 0) -> Iterator[List[Record]]:
    """Chunks of index-only records ``(position, index, index, (lengths, 0, 0))`` in sampler order,
    from position ``skip`` on (the sample is its dataset index: workers read it).

    Example:
        >>> next(known_records([2, 2, 0], np.array([[5], [6], [7]]), skip=1))
        [(1, 2, 2, ((7,), 0, 0)), (2, 0, 0, ((5,), 0, 0))]
    """
    chunk: List[Record] = []
    for position, index in enumerate(order):
        if position < skip:
            continue
        index = int(index)
        chunk.append((position, index, index, (tuple(int(v) for v in lengths[index]), 0, 0)))
        if len(chunk) == _CHUNK:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


class PlannedBatchSampler(Sampler[List[Any]]):
    """The inner loader's batch sampler: the keys of the current epoch's planned batches, ``keys(indices)``
    of each batch's dataset indices (odb.data.declared.DeclaredLengths.keys: with their declared lengths).

    The step info and resume cursor of every list it hands out wait in ``infos``, in
    order (the inner loader returns batches in the order of its batch sampler).
    """

    def __init__(self, keys: Callable[[List[int]], List[Any]]) -> None:
        self.keys = keys
        self.plan: Optional[Iterator[Tuple[Any, Cursor]]] = None
        self.infos: Deque[Tuple[ODBStepInfo, Cursor]] = collections.deque()

    def next_epoch(self, plan: Iterator[Tuple[Any, Cursor]]) -> None:
        """The next iteration hands out ``plan``'s index lists (an epoch's planned batches with their cursors)."""
        self.plan = plan
        self.infos.clear()

    def __iter__(self) -> Iterator[List[Any]]:
        plan, self.plan = self.plan, None
        if plan is None:
            raise RuntimeError("odb's planned batch sampler was iterated outside the odb loader. "
                               "Fix: iterate the ODBDataLoader, not its inner loader.")
        for ids, cursor in plan:
            info = pop_step_info(ids)
            self.infos.append((info, cursor))
            yield self.keys([int(i) for i in ids])


class GroupCollate:
    """Collate of the inner loader in workers over ``(index, declared, sample)`` items
    (odb.data.declared.DeclaredDataset): an optional per-sample transform, each sample checked against its
    declared lengths (``check``: odb.data.declared.DeclaredLengthCheck), then the user's collate. Returns the
    batch with the samples that loaded shorter than declared (``Checked``).

    Example:
        >>> from odb.data.declared import DeclaredLengthCheck
        >>> GroupCollate(len, None, DeclaredLengthCheck(None))([(0, (2,), [7, 8]), (1, (3,), [9])])
        Checked(batch=2, shorter=((1, (3,), (1,)),))
    """

    def __init__(self, collate_fn: Callable[[List[Any]], Any], transform: Optional[Callable[[Any], Any]],
                 check: DeclaredLengthCheck) -> None:
        self.collate_fn, self.transform, self.check = collate_fn, transform, check

    def __call__(self, items: List[Tuple[int, Tuple[int, ...], Any]]) -> Checked:
        samples, shorter = [], []
        for index, declared, sample in items:
            if self.transform is not None:
                sample = self.transform(sample)
            found = self.check(index, declared, sample)
            if found is not None:
                shorter.append(found)
            samples.append(sample)
        return Checked(self.collate_fn(samples), tuple(shorter))


def _loss_tokens(batch: Any, cfg: ODBConfig, fallback: int) -> int:
    """Supervised tokens of a collated batch (``fallback`` when it holds no label tensor)."""
    tokens = batch_loss_tokens(batch, cfg.label_key, cfg.ignore_index, cfg.shift_labels)
    return fallback if tokens is None else tokens


def finish_step(micro: Sequence[Tuple[Any, ODBStepInfo]], cfg: ODBConfig, exchange: Any,
                totals: Optional[Sequence[int]] = None, wait_s: float = 0.0) -> List[Any]:
    """The micro-batches of one optimizer step with their supervised tokens and loss scales filled in
    (and ``loader_wait_s=wait_s``).

    ``totals`` (all ranks', this rank's supervised tokens of the whole step) are given for the rest
    of a step that a resume split: they were exchanged before the interruption."""
    local = [0 if info.is_ghost else _loss_tokens(batch, cfg, info.real_tokens) for batch, info in micro]
    local_total = sum(local)
    if totals is not None:
        world, total, local_total = (exchange.world_size if exchange is not None else 1), *map(int, totals)
    elif exchange is not None:
        # Always as many entries as a step can hold (a shorter step pads), so a rank that fails before it
        # knows its next step's size can still announce it (odb.comm.protocol.RankExchange.announce);
        # check_peers: then each micro-batch's digest, compared between the peers of a replica.
        capacity = cfg.micro_steps_capacity(exchange.world_size)
        message = np.zeros(step_message_shape(cfg, exchange.world_size), dtype=np.int64)
        message[:len(local)] = local
        if cfg.check_peers:
            message[capacity:capacity + len(micro)] = [batch_digest(b, i, cfg.step_info_key) for b, i in micro]
        gathered = exchange.all_gather(message, f"epoch {micro[0][1].epoch}, micro-batch {micro[0][1].micro_batch}")
        world, total = exchange.world_size, int(gathered[:, :capacity].sum())
    else:
        world, total = 1, sum(local)
    out = []
    for (batch, info), tokens in zip(micro, local):
        scale = 0.0 if info.is_ghost else loss_scale(cfg.loss_scaling, tokens, total, local_total, world,
                                                     info.loss_scale)
        info = dataclasses.replace(info, local_loss_tokens=tokens, global_loss_tokens=total, loss_scale=scale,
                                   loader_wait_s=wait_s)
        out.append(attach_step_info(batch, info, cfg.step_info_key))
    return out


def known_epoch(batches: Iterator[Any], sampler: PlannedBatchSampler, cfg: ODBConfig, exchange: Any,
                on_batch: Callable[[Cursor, float, int], None],
                resume_totals: Optional[Sequence[int]] = None, watch: Optional[WorkerWatch] = None) -> Iterator[Any]:
    """Batches from the inner loader with their step infos, an optimizer step at a time.

    ``on_batch(cursor, waited_s, loss_tokens)`` is told of every batch handed to the training loop.
    A resumed epoch may start inside an optimizer step: its first step is the rest of that one,
    scaled by the step's ``resume_totals`` (saved in the state).
    When the epoch ends early (an error, e.g. in a worker's collate, or the loop stopped), the
    other ranks learn it at their next step exchange instead of waiting there; a worker of ``watch``
    that died is announced as the cause.
    """
    try:
        yield from _known_steps(batches, sampler, cfg, exchange, on_batch, resume_totals)
    except BaseException as err:
        error = None if isinstance(err, GeneratorExit) else err
        try:
            announce_to_steps(exchange, cfg, error, watch.failure if watch is not None else None)
        except Exception as late:  # raised meanwhile by a signal handler (torch's, for a worker that died)
            announce_to_steps(exchange, cfg, late)
            raise late from err
        raise


def announce_to_steps(exchange: Any, cfg: ODBConfig, error: Optional[BaseException],
                      cause: Optional[Callable[[Optional[BaseException]], Optional[BaseException]]] = None) -> None:
    """Join the next step exchange (``finish_step``'s message) with ``error`` (None: a stop), in the background
    (odb.comm.protocol.announce_in_background; nothing without an exchange)."""
    world = exchange.world_size if exchange is not None else 1
    announce_in_background(exchange, step_message_shape(cfg, world), "the next step exchange", error, cause)


def step_message_shape(cfg: ODBConfig, world: int) -> Tuple[int]:
    """The shape of a step's exchange with known lengths: each micro-batch's supervised tokens (as many entries as
    a step can hold), then with ``check_peers`` as many digests."""
    return (cfg.micro_steps_capacity(world) * (2 if cfg.check_peers else 1),)


def _known_steps(batches: Iterator[Any], sampler: PlannedBatchSampler, cfg: ODBConfig, exchange: Any,
                 on_batch: Callable[[Cursor, float, int], None],
                 resume_totals: Optional[Sequence[int]] = None) -> Iterator[Any]:
    import time

    while True:
        t0 = time.perf_counter()
        try:
            first = next(batches)
        except StopIteration:
            return
        info, cursor = sampler.infos.popleft()
        micro = [(first, info, cursor)]
        while len(micro) < info.micro_steps - info.micro_step:  # a resume may start inside a step
            batch = next(batches)
            micro.append((batch,) + sampler.infos.popleft())
        waited = (time.perf_counter() - t0) / len(micro)
        totals = resume_totals if info.micro_step > 0 else None
        finished = finish_step([(b, i) for b, i, _ in micro], cfg, exchange, totals, waited)
        infos = [b[cfg.step_info_key] if isinstance(b, Mapping) else getattr(b, cfg.step_info_key) for b in finished]
        step_tokens = (infos[0].global_loss_tokens,
                       int(totals[1]) if totals is not None else sum(f.local_loss_tokens for f in infos))
        for batch, filled, (_, info, cursor) in zip(finished, infos, micro):
            on_batch(dataclasses.replace(cursor, step_tokens=step_tokens), waited, filled.local_loss_tokens)
            yield batch
