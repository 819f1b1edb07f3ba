"""How an epoch run hands out its planned steps: ``StepEmission`` (the steps planned and not emitted yet, the
micro-batches of the optimizer step under way, the ghost's sample) and ``BatchCollate`` (a micro-batch's
samples collated, now or lazily by whichever thread needs it first: odb.epoch.pipeline.LazyBatch).

``StepEmission``'s state is the ``pending``, ``micro``, ``micro_pos`` and ``ghost`` keys of the run state's
``position`` (odb.epoch.run_state).
"""

from __future__ import annotations

import collections
import copy
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

from odb.epoch.pipeline import LazyBatch
from odb.epoch.pool import SamplePool
from odb.epoch.ranks import Step
from odb.epoch.run_state import step_from_row, step_row
from odb.plan.ranks.align import MicroBatchPlan
from odb.step_info import ODBStepInfo, attach_step_info

Ghost = Tuple[int, Any, Any, int]  # (position, sample copy, meta, dataset index)


class StepEmission:
    """The steps planned and not emitted yet (``pending``), the micro-batches of the optimizer step being
    emitted (``step_batches``, the next at ``step_pos``) and the sample a ghost batch copies (``ghost``).

    Example:
        >>> emission = StepEmission()
        >>> emission.add([(MicroBatchPlan(0, 1, 1, 1, 1), np.array([4])), (MicroBatchPlan(0, 1, 1, 1, 1), np.array([5]))])
        >>> emission.start_step(None)
        >>> plan, ids, micro, j = emission.next_micro()
        >>> ids.tolist(), len(micro), j, emission.planned()
        ([4], 2, 0, 1)
    """

    def __init__(self) -> None:
        self.pending: Deque[Step] = collections.deque()
        self.step_batches: List[Step] = []
        self.step_pos = 0
        self.ghost: Optional[Ghost] = None

    @property
    def step_over(self) -> bool:
        """Every micro-batch of the optimizer step under way has been emitted."""
        return self.step_pos >= len(self.step_batches)

    @property
    def done(self) -> bool:
        """Nothing planned is left to emit."""
        return not self.pending and self.step_over

    def planned(self) -> int:
        """Steps planned and not emitted yet."""
        return len(self.step_batches) - self.step_pos + len(self.pending)

    def wants(self, micro_steps: Optional[int]) -> bool:
        """Whether the next optimizer step needs more planned steps (``micro_steps``: its micro-batches; None:
        a window's steps, however many)."""
        return len(self.pending) < micro_steps if micro_steps is not None else not self.pending

    def add(self, steps: List[Step]) -> None:
        self.pending.extend(steps)

    def start_step(self, micro_steps: Optional[int]) -> None:
        """The next optimizer step: its ``micro_steps`` pending steps (None: all of them)."""
        take = len(self.pending) if micro_steps is None else min(micro_steps, len(self.pending))
        self.step_batches = [self.pending.popleft() for _ in range(take)]
        self.step_pos = 0

    def next_micro(self) -> Tuple[MicroBatchPlan, Optional[np.ndarray], List[MicroBatchPlan], int]:
        """The next micro-batch: its plan and positions (None: a ghost), its step's plans and its index."""
        j = self.step_pos
        self.step_pos += 1
        plan, ids = self.step_batches[j]
        return plan, ids, [p for p, _ in self.step_batches], j

    def offer_ghost(self, sid: int, sample: Any, meta: Any, index: int) -> None:
        """The first sample held becomes the ghost's, a copy: the user's collate_fn may change the real sample
        when it is emitted."""
        if self.ghost is None:
            self.ghost = (sid, copy.deepcopy(sample), meta, index)

    def keep_ghost_recent(self, pool: SamplePool) -> None:
        """A stream resumes from before the first sample its state holds, the ghost's included: keep the
        ghost a copy of a held sample, so the stream's replay stays about a window long."""
        low = pool.lowest()
        if self.ghost is not None and low is not None and self.ghost[0] < low:
            self.ghost = (low, copy.deepcopy(pool.sample(low)), pool.meta(low), pool.indices([low])[0])

    def state_dict(self) -> Dict[str, Any]:
        """The ``pending``, ``micro``, ``micro_pos`` and ``ghost`` keys of the run's position."""
        # Micro-batches of the current optimizer step already emitted keep only their
        # summaries (the loss-scale denominator needs them), not their samples.
        micro = [step_row((plan, None) if k < self.step_pos else (plan, ids))
                 for k, (plan, ids) in enumerate(self.step_batches)]
        return {"pending": [step_row(e) for e in self.pending], "micro": micro, "micro_pos": self.step_pos,
                "ghost": None if self.ghost is None else int(self.ghost[0])}

    def load_state_dict(self, position: Dict[str, Any], samples: Dict[int, Tuple[int, Any, Any]]) -> None:
        """Continue from the run's ``position``; ``samples``: (dataset index, sample, meta) of its positions."""
        if position["ghost"] is not None:
            gid = int(position["ghost"])
            index, sample, meta = samples[gid]
            self.ghost = (gid, copy.deepcopy(sample), meta, int(index))  # the pool may emit the same sample
        self.pending.extend(step_from_row(r) for r in position["pending"])
        self.step_batches = [step_from_row(r) for r in position["micro"]]
        self.step_pos = int(position["micro_pos"])


class BatchCollate:
    """A micro-batch's samples made the user's batch: ``collate``, then ``finalize`` (e.g. pinning), with
    the step info attached under ``key``; ``lazy``: left to whichever thread needs it first (one lock per
    epoch: the user's collate_fn never runs on two threads at once).

    Example:
        >>> BatchCollate(lambda samples: {"n": sum(samples)}, None, "info", lazy=False).make([1, 2], None)
        {'n': 3, 'info': None}
    """

    def __init__(self, collate: Callable[[List[Any]], Any], finalize: Optional[Callable[[Any], Any]], key: str,
                 *, lazy: bool) -> None:
        self.collate, self.finalize, self.key, self.lazy = collate, finalize, key, lazy
        self.lock = threading.Lock()

    def make(self, samples: List[Any], info: ODBStepInfo) -> Any:
        """The batch of ``samples`` with ``info``: collated now, or a LazyBatch."""
        if self.lazy:
            return LazyBatch(samples, info, self.finish, self.lock)
        return self.finish(samples, info)

    def finish(self, samples: List[Any], info: ODBStepInfo) -> Any:
        batch = self.collate(samples)
        if self.finalize is not None:
            batch = self.finalize(batch)
        return attach_step_info(batch, info, self.key)
