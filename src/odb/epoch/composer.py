"""Which of this rank's samples form each optimizer step: the step composer (``composition``) of an epoch.

With the user's batch (``global_batch_size``) an epoch's windows are its optimizer steps. ``StepComposer``
reads the source a block of its composition's ``block_steps`` steps' shares at a time, has the block composed
(odb.plan.steps.composition: pure), and hands out one composed step at a time (``next_step``). Its state is the run
state's ``position["composed"]`` (odb.epoch.run_state): the steps composed and not handed out yet (their
positions: samples the run holds, which a resume reads again), the blocks read and whether the data ended.

Example:
    >>> from odb.data.source import SampleSource
    >>> from odb.plan.steps.composition import make_composition
    >>> records = [[(p, p, f"s{p}", ((n,), n, 0)) for p, n in enumerate([5, 40, 6, 41])]]
    >>> source = SampleSource(records, cap_samples=8, cap_tokens=None, threaded=False)
    >>> composer = StepComposer(make_composition("length_grouped", block_steps=2), 2, seed=0, epoch=0)
    >>> new, ids, ended = composer.next_step(source)
    >>> len(new), sorted(ids) in ([0, 2], [1, 3]), ended
    (4, True, False)
    >>> new, ids, ended = composer.next_step(source)
    >>> new, ended
    ([], True)
"""

from __future__ import annotations

import collections
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np

from odb.data.source import Record, SampleSource
from odb.plan.steps.composition import Composition


def fresh_composed() -> Dict[str, Any]:
    """The composer's state at the start of an epoch (nothing composed, no block read)."""
    return {"queued": [], "blocks": 0, "ended": False}


class StepComposer:
    """Composes this rank's optimizer steps by ``composition`` (odb.plan.steps.composition), ``step_samples`` samples
    each (this rank's share), its random draws from ``seed`` and ``epoch`` (the same on every rank)."""

    def __init__(self, composition: Composition, step_samples: int, *, seed: int, epoch: int) -> None:
        self.composition, self.step_samples = composition, step_samples
        self.seed, self.epoch = seed, epoch
        self.queued: Deque[List[int]] = collections.deque()  # composed steps not handed out (positions)
        self.blocks = 0
        self.ended = False  # the source ended with the last block read

    def next_step(self, source: SampleSource) -> Tuple[List[Record], List[int], bool]:
        """The records read from ``source`` now (a new block's, or none), the positions of the next optimizer
        step's samples (none once the data has ended), and whether that step is the epoch's last here."""
        new: List[Record] = []
        if not self.queued and not self.ended:
            new = self._read_block(source)
            self._compose(new)
        ids = self.queued.popleft() if self.queued else []
        return new, ids, self.ended and not self.queued

    def _read_block(self, source: SampleSource) -> List[Record]:
        want = self.composition.block_steps * self.step_samples
        records: List[Record] = []
        while len(records) < want and not self.ended:
            more, self.ended = source.take(want - len(records), None)
            records.extend(more)
        return records

    def _compose(self, records: List[Record]) -> None:
        if not records:
            return
        lengths = np.array([r[3][0] for r in records], dtype=np.int64).reshape(len(records), -1)
        steps = self.composition.compose(lengths, self.step_samples, seed=self.seed, epoch=self.epoch,
                                         block=self.blocks, first_step=self.blocks * self.composition.block_steps)
        positions = [int(r[0]) for r in records]
        self.queued.extend([positions[int(i)] for i in step] for step in steps)
        self.blocks += 1

    def queued_positions(self) -> List[int]:
        """The positions of the samples composed into steps not handed out yet."""
        return [p for step in self.queued for p in step]

    def state_dict(self) -> Dict[str, Any]:
        """The run state's ``position["composed"]`` (plain data, shared with nothing)."""
        return {"queued": [list(step) for step in self.queued], "blocks": self.blocks, "ended": self.ended}

    def reset(self, state: Optional[Dict[str, Any]] = None) -> None:
        """Continue from ``state_dict``'s output (None: the start of the epoch)."""
        state = state if state is not None else fresh_composed()
        self.queued = collections.deque([int(p) for p in step] for step in state["queued"])
        self.blocks, self.ended = int(state["blocks"]), bool(state["ended"])
