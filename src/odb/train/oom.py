"""Recover a training micro-batch from an out-of-memory error: exactly, and in step across ranks.

``train_step_with_oom_fallback`` runs forward and backward of one micro-batch. On
``torch.OutOfMemoryError`` it reruns the batch in halves (recursively) with loss
weights that keep the gradient exact (policy "split"), or drops it (policy "skip").
Under DDP every rank learns every other rank's outcome through odb's metadata
exchange, so all ranks run the same number of forward/backward passes with the same
DDP sync flags and no rank waits forever in a collective. See docs/oom-and-generation.md.

Why exact: the loss of a batch is a mean over its weight W (supervised tokens); a
piece with weight w_i run at ``loss_scale * w_i / W`` adds exactly its share. A
backward that ran out of memory may already have added the whole batch's gradient to
some parameters (autograd accumulates leaf by leaf); those are found by their
gradient's version counter and masked (their gradient gets zero) while the pieces run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from typing import Any, Callable, ContextManager, List, Literal, Optional, Set, Tuple

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from odb.private_api import read
from odb.train.batch_split import BatchSplitter, PaddedBatchSplitter
from odb.comm.dist import GroupExchanges, world
from odb.comm.protocol import RankExchange
from odb.train.loss import zero_loss
from odb.train.oom_peers import PeerRound
from odb.step_info import ODBStepInfo

OOMPolicy = Literal["split", "skip"]
SyncPass = Literal["last", "extra"]
OOM_ERRORS: Tuple[type, ...] = (torch.OutOfMemoryError,)  # torch.cuda.OutOfMemoryError is the same class
SYNCED_OOM = ("odb: out of memory inside a backward that synchronizes gradients across ranks; the other ranks are "
              "already in that collective, so this cannot be recovered. Fix: pass sync_pass='extra' and "
              "no_sync=model.no_sync (all work runs without sync, then a one-row pass syncs), or lower token_budget.")
_EXCHANGE_TIMEOUT_S = 1800.0  # ODBConfig's default: the loader's metadata group, when it uses the default


class ODBOOMError(RuntimeError):
    """An out-of-memory error that cannot be recovered without breaking the gradient or the collectives."""


@dataclasses.dataclass
class OOMCounters:
    """OOM handling on this rank, summed over calls; ``as_dict()`` feeds a metrics logger."""

    oom_errors: int = 0  # out-of-memory errors caught on this rank
    micro_batches_with_oom: int = 0  # micro-batches in which any rank ran out of memory
    split_micro_batches: int = 0  # micro-batches this rank ran in pieces (action "split")
    extra_passes: int = 0  # forward/backward passes beyond one per micro-batch (pieces, reruns, alignment)
    skipped_micro_batches: int = 0  # micro-batches of which this rank dropped rows
    skipped_rows: int = 0
    inexact_micro_batches: int = 0  # micro-batches whose gradient could not be kept exact (any rank)
    # A loader's counters (loader.odb_oom_counters): what the loader learns from an OOM (token_budget="auto"),
    # and where the fallback's exchange comes from (the loader's ranks: a mesh's peers split alike). Not counters.
    on_oom: Optional[Callable[[], None]] = dataclasses.field(default=None, repr=False, compare=False)
    exchanges: Optional[Callable[[float], RankExchange]] = dataclasses.field(default=None, repr=False, compare=False)
    made: Optional[RankExchange] = dataclasses.field(default=None, repr=False, compare=False)

    def add(self, outcome: "StepOutcome") -> None:
        """Count one call's outcome."""
        self.oom_errors += outcome.local_ooms
        self.micro_batches_with_oom += outcome.any_oom
        self.split_micro_batches += outcome.action == "split"
        self.extra_passes += outcome.passes - 1
        self.skipped_micro_batches += outcome.skipped_rows > 0
        self.skipped_rows += outcome.skipped_rows
        self.inexact_micro_batches += not outcome.exact

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.repr}

    def exchange(self) -> Optional[RankExchange]:
        """The exchange the fallback agrees on: a loader's counters (``loader.odb_oom_counters``) make one over the
        loader's ranks the first time (a collective: every rank's first call) and keep it, so a mesh's peers
        split alike; None elsewhere (the fallback then uses the default group's)."""
        if self.made is None and self.exchanges is not None:
            self.made = self.exchanges(_EXCHANGE_TIMEOUT_S)
        return self.made


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What ``train_step_with_oom_fallback`` did with one micro-batch on this rank."""

    action: Literal["ok", "split", "skip"]  # one pass / pieces / rows dropped
    passes: int  # forward/backward passes run (the same on every rank)
    local_ooms: int  # out-of-memory errors caught on this rank
    any_oom: bool  # some rank ran out of memory on this micro-batch
    skipped_rows: int  # rows of this rank's batch whose loss is not in the gradient
    exact: bool  # every rank's gradient holds each kept row once; if False, skip the optimizer step everywhere
    loss: Optional[torch.Tensor]  # what was backpropagated (sum over pieces of scale x loss), detached


@dataclasses.dataclass(frozen=True)
class _Item:
    rows: Optional[Tuple[int, ...]]  # None: the whole batch as given
    masked: frozenset  # indices of parameters whose gradient already holds this item's share
    ghost: bool = False  # only keeps the passes aligned across ranks; adds nothing


def train_step_with_oom_fallback(
    loss_fn: Callable[[Any], torch.Tensor],
    batch: Any,
    info: ODBStepInfo,
    *,
    model: torch.nn.Module,
    policy: OOMPolicy = "split",
    backward: Optional[Callable[[torch.Tensor], None]] = None,
    no_sync: Optional[Callable[[], ContextManager]] = None,
    sync: Optional[bool] = None,
    sync_pass: SyncPass = "last",
    exchange: Optional[RankExchange] = None,
    splitter: Optional[BatchSplitter] = None,
    counters: Optional[OOMCounters] = None,
) -> StepOutcome:
    """Forward + backward of one micro-batch, falling back to pieces (or a skip) on out-of-memory.

    Args:
        loss_fn: ``loss_fn(batch) -> loss``, the mean loss over the batch's weight
            (e.g. ``lambda b: model(**b).loss``); backward is run here on ``loss * scale``.
        batch, info: the batch and its popped ``ODBStepInfo`` (``info.loss_scale`` is used).
        model: the model being trained (DDP-wrapped or not); its parameters get the gradient.
        policy: "split" (halve until it fits; a single row that still fails is dropped)
            or "skip" (drop the micro-batch).
        backward: ``backward(loss)``; default ``loss.backward()`` (e.g. pass
            ``accelerator.backward`` or ``lambda l: scaler.scale(l).backward()``).
        no_sync: context factory under which backward does not communicate; default
            ``model.no_sync`` (DDP). Under several ranks without one every pass is taken
            to communicate, so an OOM inside backward cannot be recovered (pass
            ``contextlib.nullcontext`` when backward never communicates).
        sync: whether gradients must be synchronized in this micro-batch (default
            ``info.is_last_micro_step``).
        sync_pass: "last" (the last pass syncs, as plain DDP; an OOM inside that
            backward raises ODBOOMError) or "extra" (all work runs without sync, then a
            one-row pass with zero weight syncs: every OOM of the real work recovers).
        exchange: odb's metadata exchange (default: the default group's, when
            torch.distributed runs with more than one rank).
        splitter: how to cut the batch (default ``PaddedBatchSplitter()``).
        counters: an ``OOMCounters`` to add this call's counts to (``loader.odb_oom_counters``: a
            loader with ``token_budget="auto"`` then also learns that its batch ran out of memory).

    Example:
        >>> model = torch.nn.Linear(2, 1)
        >>> info = ODBStepInfo(0, 0, 4, 4, 4, 4, 8, 8, 1.0, False)
        >>> batch = {"x": torch.ones(4, 2), "labels": torch.ones(4, 1)}
        >>> out = train_step_with_oom_fallback(lambda b: ((model(b["x"]) - b["labels"]) ** 2).mean(), batch, info,
        ...                                    model=model)
        >>> out.action, out.passes
        ('ok', 1)
    """
    if policy not in ("split", "skip"):
        raise ValueError(f"policy={policy!r}: must be 'split' or 'skip'. Fix: pass policy='split' (exact pieces) "
                         f"or 'skip' (drop the micro-batch).")
    if sync_pass not in ("last", "extra"):
        raise ValueError(f"sync_pass={sync_pass!r}: must be 'last' or 'extra'. Fix: pass 'last' (plain DDP "
                         f"overlap) or 'extra' (every OOM of the real work recoverable).")
    if no_sync is None and world()[1] > 1:
        no_sync = getattr(model, "no_sync", None)
    if exchange is None and counters is not None:
        exchange = counters.exchange()
    run = _Run(loss_fn, batch, info, model, policy, backward, no_sync,
               info.is_last_micro_step if sync is None else sync, sync_pass, exchange, splitter)
    outcome = run.execute()
    if counters is not None:
        counters.add(outcome)
        if counters.on_oom is not None and outcome.local_ooms:  # a loader with token_budget="auto" learns of it
            counters.on_oom()
    return outcome


def release_memory() -> None:
    """Drop unreachable tensors and return cached CUDA blocks (after an out-of-memory error)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        gc.collect()  # tensors of the failed pass may sit in reference cycles (tracebacks)
        torch.cuda.empty_cache()


@dataclasses.dataclass
class _Tally:
    """What one micro-batch's run did on this rank so far: passes run, out-of-memory errors caught here, rows
    skipped; whether some rank ran out of memory, whether a kept row's share is missing (inexact), whether the
    batch was split; the scaled losses backpropagated (detached)."""

    passes: int = 0
    local_ooms: int = 0
    skipped: int = 0
    any_oom: bool = False
    inexact: bool = False
    split: bool = False
    losses: List[torch.Tensor] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Sync:
    """When a pass synchronizes gradients: ``no_sync`` (the model's context, or None: every pass syncs),
    ``sync_step`` (this micro-batch ends the optimizer step), ``sync_pass`` ("last" or "extra") and ``rearm``
    (the next pass syncs on every rank: DDP prepared for a syncing backward that another rank's failure
    dropped)."""

    no_sync: Optional[Callable[[], Any]]
    sync_step: bool
    sync_pass: str
    rearm: bool = False


class _Run:
    def __init__(self, loss_fn, batch, info, model, policy, backward, no_sync, sync_step, sync_pass, exchange,
                 splitter) -> None:
        self.loss_fn, self.batch, self.policy, self.model = loss_fn, batch, policy, model
        self.scale = float(info.loss_scale)
        self.params = [p for p in model.parameters() if p.requires_grad]
        read(torch.zeros(()), "Tensor", "_version")  # checked once (odb.private_api): _grad_state reads every gradient's
        self.backward = backward or torch.Tensor.backward
        self.sync = _Sync(no_sync, sync_step, sync_pass)
        if exchange is None and world()[1] > 1:
            exchange = GroupExchanges()(_EXCHANGE_TIMEOUT_S)
        self.exchange = exchange if exchange is not None and exchange.processes > 1 else None
        replicas = self.exchange.replicas if self.exchange is not None else None
        # under a mesh the peers of a replica split alike (odb.train.oom_peers)
        self.peers = replicas if replicas is not None and replicas.peers > 1 else None
        self.splitter = splitter or PaddedBatchSplitter()
        self.n_rows = self.splitter.rows(batch)
        if self.n_rows < 1:
            raise ValueError("the batch has 0 rows: nothing to run. Fix: pass a batch with at least one row.")
        self._total_weight: Optional[float] = None
        self.tally = _Tally()
        self.round: Optional[np.ndarray] = None

    def execute(self) -> StepOutcome:
        pending, n = [_Item(None, frozenset())], 1
        ghost = _Item((0,), frozenset(range(len(self.params))), ghost=True)
        while n:
            nxt: List[_Item] = []
            peer_round = PeerRound(self.peers, self.exchange.process_rank, n) if self.peers is not None else None
            outcomes: List[Tuple[_Item, Set[int], bool]] = []
            for j in range(n):
                item = pending[j] if j < len(pending) else ghost
                synced = self.sync.no_sync is None or self.sync.rearm or (self.sync.sync_step and self.sync.sync_pass == "last"
                                                                  and j == n - 1)
                self.sync.rearm, self.round = False, None
                if peer_round is not None:
                    failed, acc, again = self._peer_pass(item, synced)
                    if not item.ghost:
                        peer_round.record(j, failed=failed, holds=bool(item.masked | acc))
                        outcomes.append((item, acc, again))
                    continue
                nxt += [x for x in self._pass(item, synced, len(nxt)) if not x.ghost]
            if peer_round is not None:
                n, pending = self._settle(peer_round, outcomes)
                continue
            if self.exchange is None:
                n = len(nxt)
            else:  # the round's outcome, unless the last pass's check before backward already told it
                got = self.round if self.round is not None else self.exchange.all_gather(
                    np.array([0, len(nxt), self.tally.local_ooms, self.tally.inexact]), "an OOM round")
                n, self.tally.any_oom, self.tally.inexact = int(got[:, 1].max()), bool(got[:, 2].any()), bool(got[:, 3].any())
            pending = nxt
        if self.exchange is not None and self.sync.no_sync is not None and self.sync.sync_step and self.sync.sync_pass == "extra":
            if self._pass(ghost, synced=True):
                raise ODBOOMError("odb: the one-row pass at zero weight that synchronizes gradients ran out of "
                                  "memory on some rank. Fix: lower token_budget.")
        self.tally.any_oom = self.tally.any_oom or self.tally.local_ooms > 0
        action = "skip" if self.tally.skipped else "split" if self.tally.split else "ok"
        loss = torch.stack([x.reshape(()) for x in self.tally.losses]).sum() if self.tally.losses else None
        return StepOutcome(action, self.tally.passes, self.tally.local_ooms, self.tally.any_oom, self.tally.skipped,  # type: ignore[arg-type]
                           not self.tally.inexact, loss)

    def _pass(self, item: _Item, synced: bool, queued: int = 0) -> List[_Item]:
        """Run one piece; returns what is left to run of it (nothing, itself, or its halves)."""
        self.tally.passes += 1
        acc: Set[int] = set()
        with self.sync.no_sync() if self.sync.no_sync is not None and not synced else contextlib.nullcontext():
            oom, loss, scale, masked = self._forward(item, synced)
            if synced and self.exchange is not None:  # nobody enters a syncing backward unless all forwards worked
                # (with what the round needs next: if all worked, this backward completes or raises)
                got = self.exchange.all_gather(np.array([oom, queued, self.tally.local_ooms, self.tally.inexact]),
                                               "an OOM check before backward")
                self.round = None if got[:, 0].any() else got
                if got[:, 0].any():
                    # Another rank failed: drop this graph and run the item again. DDP, having prepared
                    # for a syncing backward, would reduce in the next backward even under no_sync, so
                    # the next pass syncs on every rank.
                    del loss
                    self.sync.rearm = True
                    return self._failed(item, acc) if oom else [item]
            elif oom:
                return self._failed(item, acc)
            oom, acc = self._backward(item, loss, scale, masked)
        if not oom:
            return []
        release_memory()
        if synced and self.exchange is not None:
            raise ODBOOMError(SYNCED_OOM)
        return self._failed(item, acc)

    def _forward(self, item: _Item, synced: bool) -> Tuple[bool, Any, float, frozenset]:
        """(out of memory, the loss, its scale, the masked parameters) of one piece's forward."""
        oom, loss, scale, masked = False, None, 0.0, item.masked
        try:
            piece, scale, masked = self._piece(item)
            loss = self.loss_fn(piece)
        except OOM_ERRORS:
            oom = True
        piece = None
        if oom:
            release_memory()
            if isinstance(self.model, DDP):  # as DDP's post-forward sets it on the ranks whose forward ended:
                # whether the next forward broadcasts buffers must match across ranks
                self.model.require_forward_param_sync = synced and torch.is_grad_enabled()
        return oom, loss, scale, masked

    def _backward(self, item: _Item, loss: Any, scale: float, masked: frozenset) -> Tuple[bool, Set[int]]:
        """(out of memory, the parameters whose gradient the backward reached) of one piece's backward; masked
        parameters get a zero gradient."""
        handles = [self.params[i].register_hook(_zero_grad) for i in masked]
        before = self._grad_state()
        oom, scaled = False, None
        try:
            # A piece that adds nothing (no supervised token, a ghost) may have a NaN mean: an exact zero instead.
            scaled = zero_loss(loss) if scale == 0 else loss * scale
            self.backward(scaled)
            if not item.ghost:
                self.tally.losses.append(scaled.detach())
        except OOM_ERRORS:
            oom = True
        finally:
            for h in handles:
                h.remove()
            acc = self._accumulated(before)
            del loss, scaled, before
        return oom, acc

    def _peer_pass(self, item: _Item, synced: bool) -> Tuple[bool, Set[int], bool]:
        """Under a mesh: run one piece; (it ran out of memory here or, at a syncing pass, on a peer of this
        replica; the parameters whose gradient it reached here; run it again whole: another replica failed
        before a syncing backward). What is left of it is decided for the whole replica (``_settle``)."""
        self.tally.passes += 1
        acc: Set[int] = set()
        with self.sync.no_sync() if self.sync.no_sync is not None and not synced else contextlib.nullcontext():
            oom, loss, scale, masked = self._forward(item, synced)
            self.tally.local_ooms += oom
            if synced:  # nobody enters a syncing backward unless every forward worked
                got = self.exchange.all_gather(np.array([oom]), "an OOM check before backward", every_process=True)
                if got.any():
                    del loss
                    self.sync.rearm = True
                    here = bool(got[[p for p, r in enumerate(self.peers.replica)
                                     if r == self.peers.replica[self.exchange.process_rank]]].any())
                    if item.ghost and oom:
                        self._failed(item, acc)  # raises
                    return here, acc, not here
            elif oom:
                if item.ghost:
                    self._failed(item, acc)  # raises
                return True, acc, False
            oom, acc = self._backward(item, loss, scale, masked)
            self.tally.local_ooms += oom
        if oom:
            release_memory()
            if synced:
                raise ODBOOMError(SYNCED_OOM)
            if item.ghost:
                self._failed(item, acc)  # raises
        return oom, acc, False

    def _settle(self, peer_round: PeerRound, outcomes: List[Tuple[_Item, Set[int], bool]]) -> Tuple[int, List[_Item]]:
        """Under a mesh, the round's end: every process's outcomes; an item that failed on a peer of this replica
        is cut on every peer alike; (passes of the next round, its items)."""
        rows = self.exchange.all_gather(peer_round.message(self.tally.local_ooms, self.tally.inexact), "an OOM round",
                                        every_process=True)
        peer_round.agree(rows)
        self.tally.any_oom = self.tally.any_oom or peer_round.ooms > 0
        self.tally.inexact = self.tally.inexact or peer_round.inexact
        if not peer_round.anywhere:
            return 0, []
        nxt: List[_Item] = []
        for j, (item, acc, again) in enumerate(outcomes):
            if peer_round.failed[j]:
                nxt += self._cut(item, acc, peer_round.held[j])
            elif again:
                nxt.append(item)
        got = self.exchange.all_gather(np.array([len(nxt), self.tally.inexact]), "an OOM round (its pieces)",
                                       every_process=True)
        self.tally.inexact = bool(got[:, 1].any())
        return int(got[:, 0].max()), nxt

    def _cut(self, item: _Item, acc: Set[int], held: bool) -> List[_Item]:
        """The pieces of an item that failed on some peer of this replica (the same on every peer: ``held``,
        whether any peer's gradient holds part of it, decides whether it may be dropped)."""
        masked = item.masked | acc
        rows = item.rows if item.rows is not None else tuple(range(self.n_rows))
        if (self.policy == "skip" and not held) or len(rows) == 1:
            self.tally.skipped += len(rows)
            self.tally.inexact = self.tally.inexact or held
            return []
        self.tally.split, half = True, len(rows) // 2
        return [_Item(rows[:half], masked), _Item(rows[half:], masked)]

    def _failed(self, item: _Item, acc: Set[int]) -> List[_Item]:
        self.tally.local_ooms += 1
        if item.ghost:
            raise ODBOOMError("odb: a one-row pass at zero weight, run only to keep the ranks' passes aligned, ran "
                              "out of memory. Fix: lower token_budget.")
        return self._cut(item, acc, bool(item.masked | acc))

    def _piece(self, item: _Item) -> Tuple[Any, float, frozenset]:
        if item.rows is None:
            return self.batch, self.scale, item.masked
        piece = self.splitter.take(self.batch, item.rows)
        if item.ghost:
            return piece, 0.0, item.masked
        if self._total_weight is None:
            self._total_weight = float(self.splitter.weight(self.batch))
        weight = float(self.splitter.weight(piece))
        if weight == 0 or self._total_weight == 0:  # a mean over nothing is NaN: this piece adds nothing
            return piece, 0.0, frozenset(range(len(self.params)))
        return piece, self.scale * weight / self._total_weight, item.masked

    def _grad_state(self) -> List[Tuple[Optional[torch.Tensor], int]]:
        return [(g, g._version) if (g := p.grad) is not None else (None, 0) for p in self.params]

    def _accumulated(self, before: List[Tuple[Optional[torch.Tensor], int]]) -> Set[int]:
        """Parameters whose gradient the failed backward changed (autograd adds in place or sets a new tensor)."""
        return {i for i, (p, (g, v)) in enumerate(zip(self.params, before)) if p.grad is not g or
                (g is not None and g._version != v)}


def _zero_grad(grad: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=grad.dtype, device=grad.device).expand_as(grad)
