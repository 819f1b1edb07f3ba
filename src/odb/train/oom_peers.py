"""The OOM fallback under a mesh: the peers of a data-parallel replica split a micro-batch alike.

Each peer of a replica (its tensor, context or pipeline parallel ranks) runs the same micro-batch, and the
model's own collectives make them run every pass together: a piece on one peer and the whole batch (or a
ghost) on another would hang or mix their activations. So an item (the batch, or a piece of it) that ran out of
memory on any peer counts as failed on every peer of that replica, and each peer cuts it the same way. A peer
whose pass went through holds the item's whole gradient already: the pieces run with those parameters masked
(their gradient gets zero), so every peer's gradient still holds each row once, as on one process.

``PeerRound`` keeps one round's outcomes on this process and reads every process's from a gathered message:
per item, whether it failed here and whether this process's gradient already holds part of it, as bit words.

Example (2 replicas x 2 peers; item 0 failed on process 1, the peer of process 0):
    >>> from odb.comm.replicas import Replicas
    >>> round_ = PeerRound(Replicas.grid(2, 2), process=0, items=1)
    >>> round_.record(0, failed=False, holds=True)
    >>> rows = np.stack([round_.message(), [0, 1, 0, 1, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    >>> round_.agree(rows)
    >>> round_.failed, round_.held, round_.anywhere
    ([True], [True], True)
"""

from __future__ import annotations

from typing import List

import numpy as np

from odb.comm.replicas import Replicas

BITS = 62  # flags per int64 word (non-negative)
HEAD = 3  # a round's message: status-free fields (0, this process's OOM errors, inexact), then the bit words


class PeerRound:
    """One round of the fallback on process ``process`` of ``replicas`` with ``items`` real items (the same on
    every peer of a replica; rounds of other replicas may hold other counts, so the words cover the largest
    round size ``items`` of any process: the caller passes the round's width)."""

    def __init__(self, replicas: Replicas, process: int, items: int) -> None:
        self.replicas, self.process, self.items = replicas, process, items
        self.words = max(1, -(-items // BITS))
        self.local_failed = [False] * items
        self.local_held = [False] * items
        self.failed: List[bool] = []  # agreed: the item failed on some peer of this replica
        self.held: List[bool] = []  # agreed: some peer's gradient already holds part of the item
        self.anywhere = False  # some item failed on some process of the world
        self.ooms = 0
        self.inexact = False

    def record(self, j: int, *, failed: bool, holds: bool) -> None:
        """Item ``j``'s outcome here: it ran out of memory, and whether this process's gradient holds part of it."""
        self.local_failed[j], self.local_held[j] = bool(failed), bool(holds)

    def message(self, ooms: int = 0, inexact: bool = False) -> np.ndarray:
        """This process's part of the round's gather."""
        return np.concatenate(([0, int(ooms), int(inexact)], _words(self.local_failed, self.words),
                               _words(self.local_held, self.words))).astype(np.int64)

    def agree(self, rows: np.ndarray) -> None:
        """Read every process's message (``rows``, one per process): the agreed flags of this replica's items."""
        rows = np.asarray(rows, dtype=np.int64)
        w = self.words
        mine = [p for p in range(self.replicas.processes) if self.replicas.replica[p] == self.replicas.replica[
            self.process]]
        failed = np.bitwise_or.reduce(rows[mine, HEAD:HEAD + w], axis=0)
        held = np.bitwise_or.reduce(rows[mine, HEAD + w:HEAD + 2 * w], axis=0)
        self.failed = _flags(failed, self.items)
        self.held = _flags(held, self.items)
        self.anywhere = bool(rows[:, HEAD:HEAD + w].any())
        self.ooms = int(rows[:, 1].sum())
        self.inexact = bool(rows[:, 2].any())


def _words(flags: List[bool], words: int) -> np.ndarray:
    out = np.zeros(words, dtype=np.int64)
    for j, flag in enumerate(flags):
        if flag:
            out[j // BITS] |= 1 << (j % BITS)
    return out


def _flags(words: np.ndarray, items: int) -> List[bool]:
    return [bool(int(words[j // BITS]) >> (j % BITS) & 1) for j in range(items)]
