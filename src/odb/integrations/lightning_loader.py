"""An odb loader as PyTorch Lightning's train dataloader: ``ODBLightningLoader`` (no Lightning import).

Lightning would rebuild a torch ``DataLoader`` it is given (to inject its DistributedSampler) and cut the
epoch at its ``len()``; this wrapper is neither, hands the batches over without their step infos (Lightning
moves each batch to the device, which a frozen dataclass inside it does not survive) and keeps those infos in
order for ``ODBCallback`` (odb.integrations.lightning), and makes Lightning checkpoints resume mid-epoch.

Example::

    def train_dataloader(self):
        return ODBLightningLoader(odb.ODBDataLoader(ds, token_budget=8192, batch_size=8,
                                                    sampler=odb.ShardSampler(ds)))
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, Iterator, Tuple

from odb.comm.dist import world
from odb.loader.dataloader import ODBLoaderMixin
from odb.step_info import ODBStepInfo, pop_step_info
from odb.integrations.checks import check_odb_loader
from odb.integrations.memory import measure_auto_explicitly
from odb.integrations.states import gather_states, restore_rank_state, saved_elsewhere

__all__ = ["LIGHTNING_LOOKAHEAD", "ODBLightningLoader"]

# token_budget="auto": the most batches Lightning holds fetched and not yet trained (the one training and the
# one fetched ahead), so a window's plan never waits for a batch it has not trained
LIGHTNING_LOOKAHEAD = 2
_END = object()


class ODBLightningLoader:
    """An odb loader as Lightning's train dataloader (see the module docstring for why a wrapper).

    Batches are the odb loader's, without their step info, which waits in order until
    ``ODBCallback`` hands it to the module for the batch being trained (Lightning fetches
    one batch ahead). ``state_dict``/``load_state_dict`` make Lightning checkpoints resume
    mid-epoch exactly, at the first batch not yet trained, and hold every rank's odb
    state (only rank 0 writes the checkpoint). Because of the batch fetched ahead, the
    wrapper keeps an odb state taken every ``snapshot_every`` batches and the number of
    batches trained since; a resume restores it and replays (loads and drops) those
    batches. ``snapshot_every=1`` replays nothing but takes ``loader.state_dict()`` (a
    few ms for a large ``buffer_size``) before every batch; it is also what a checkpoint
    needs to resume on another number of processes (elastic resume: the batches to replay
    belong to the saved ranks' shares), which a mid-epoch checkpoint with a replay refuses.

    Example::

        def train_dataloader(self):
            return ODBLightningLoader(odb.ODBDataLoader(ds, token_budget=8192,
                                                        sampler=odb.ShardSampler(ds)))
    """

    def __init__(self, loader: ODBLoaderMixin, snapshot_every: int = 16) -> None:
        self.loader = check_odb_loader(loader, "ODBLightningLoader")
        # token_budget="auto": Lightning fetches each training batch one ahead of training it, so the loader's
        # next() does not end a batch's step; ODBCallback measures each batch around its training instead.
        self.auto = measure_auto_explicitly(loader, LIGHTNING_LOOKAHEAD)
        if isinstance(snapshot_every, bool) or not isinstance(snapshot_every, int) or snapshot_every < 1:
            raise ValueError(f"ODBLightningLoader got snapshot_every={snapshot_every!r}: it must be an int >= 1. "
                             f"Fix: pass e.g. 16 (a resume replays fewer batches than this), or 1.")
        self.snapshot_every = snapshot_every
        self._pending: Deque[ODBStepInfo] = collections.deque()
        self._snapshots: Deque[Tuple[int, Dict[str, Any]]] = collections.deque(maxlen=2)
        self._fetched = 0
        self._replay = 0
        self._iterating = False  # between the first batch and the end of an epoch

    @property
    def odb_stats(self) -> Dict[str, Any]:
        """The odb loader's counters of the current (or last) epoch on this rank."""
        return self.loader.odb_stats

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch of the next iteration (ODBCallback calls it at every epoch start)."""
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        # A generator: Lightning calls iter() once just to check iterability; nothing runs until next().
        self._pending.clear()  # step infos of an abandoned iteration
        self._snapshots.clear()
        self._fetched = 0
        replay, self._replay = self._replay, 0
        key = self.loader.odb_config.step_info_key
        batches = iter(self.loader)
        self._iterating = True
        for _ in range(replay):  # trained before the checkpoint, after its odb state was taken
            batch = next(batches, _END)
            if batch is _END:
                break
            pop_step_info(batch, key)  # dropped, as trained: the loader's check for a forgotten pop stays quiet
        while True:
            if self._fetched % self.snapshot_every == 0:
                self._snapshots.append((self._fetched, self.loader.state_dict()))
            try:
                batch = next(batches)
            except StopIteration:
                self._iterating = False
                return
            self._fetched += 1
            self._pending.append(pop_step_info(batch, key))
            yield batch

    def next_step_info(self) -> ODBStepInfo:
        """The step info of the oldest batch handed out and not yet trained (ODBCallback calls it)."""
        if not self._pending:
            raise RuntimeError("ODBLightningLoader has no step info waiting: a batch is being trained that this "
                               "loader has not yielded yet (training_step(self, dataloader_iter) fetches after "
                               "on_train_batch_start), or next_step_info was called twice for one batch. Fix: "
                               "take the batch as training_step(self, batch, batch_idx) and let only ODBCallback "
                               "call next_step_info.")
        return self._pending.popleft()

    def state_dict(self) -> Dict[str, Any]:
        """Every rank's odb state and the batches to replay after it (call on all ranks, as Lightning does)."""
        trained = self._fetched - len(self._pending)
        if not self._iterating:  # at an epoch's end (or before any batch): the loader's own position
            local, replay = self.loader.state_dict(), 0
        else:
            usable = [(at, state) for at, state in self._snapshots if at <= trained]
            if not usable:  # the trainer fetched more than snapshot_every batches ahead of training
                raise RuntimeError(f"ODBLightningLoader cannot save a position {len(self._pending)} batches behind "
                                   f"the last one fetched with snapshot_every={self.snapshot_every}. Fix: pass "
                                   f"snapshot_every >= {len(self._pending)} (Lightning fetches 1 ahead).")
            at, local = usable[-1]
            replay = trained - at
        return {"odb_rank_states": gather_states(local, self.loader), "replay": replay}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Give the odb loader this rank's entry of ``state_dict()``; the next iteration replays the rest."""
        self._pending.clear()
        states = state.get("odb_rank_states") if isinstance(state, dict) else None
        replay = int(state.get("replay", 0)) if isinstance(state, dict) else 0
        if replay and isinstance(states, list) and states and saved_elsewhere(states):
            raise ValueError(f"ODBLightningLoader.load_state_dict got a checkpoint of {len(states)} processes whose "
                             f"odb states were taken {replay} batch(es) before it (snapshot_every > 1): those "
                             f"batches can be replayed only by as many processes as trained them, so it resumes "
                             f"on {len(states)} processes, not {world()[1]}. Fix: resume with {len(states)} "
                             f"processes, or save with ODBLightningLoader(loader, snapshot_every=1) to resume on "
                             f"another number.")
        restore_rank_state(self.loader, states, "ODBLightningLoader.load_state_dict")
        self._replay = replay
