"""Where an epoch run stands in its epoch, and its resume bookkeeping (``RunPosition``).

Its state is the run state's ``position`` (odb.epoch.run_state.POSITION_KEYS), with the emission's keys
(odb.epoch.emission.StepEmission) in their place.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

from odb.epoch.cursor import Cursor
from odb.epoch.run_state import retained_positions
from odb.epoch.stats import EpochStats


class RunPosition:
    """How many samples of the epoch's order were taken into windows (``arrived``), the windows planned
    (``window_index``) and whether the last one was (``planned_final``), the steps made (``step``); for
    odb.resume the re-partitions of this epoch's order across ranks (``layers``) and the restart points of an
    IterableDataset with its own state (``stream_marks``, odb.data.stream_state; None without), the state
    after the last planned window (``snapshot``) and the batches made since (``since``).

    Example:
        >>> position = RunPosition(None)
        >>> position.mark({"step": 4})
        >>> position.cursor(EpochStats()).since, position.cursor(EpochStats()).since
        (1, 2)
    """

    def __init__(self, stream_marks: Any) -> None:
        self.arrived = 0  # samples taken from the source into windows
        self.window_index = 0
        self.planned_final = False
        self.step = 0  # micro-batches made
        self.optimizer_step = 0  # optimizer steps whose last micro-batch was made
        self.layers: List[Dict[str, Any]] = []
        self.stream_marks: Any = stream_marks
        self.snapshot: Dict[str, Any] = {}  # state_dict() after the last planned window
        self.since = 0

    def mark(self, snapshot: Dict[str, Any]) -> None:
        """``snapshot``: the run's state now; the next batches' cursors point to it."""
        self.snapshot, self.since = snapshot, 0

    def cursor(self, stats: EpochStats) -> Cursor:
        """The cursor of one more batch made (``stats``: the counters after it)."""
        self.since += 1
        return Cursor(self.snapshot, self.since, dataclasses.replace(stats))

    def state_dict(self, emitted: Dict[str, Any], composed: Optional[Dict[str, Any]]) -> Dict[str, Any]:
        """The run state's ``position``, ``emitted`` (the emission's keys) and ``composed`` (the step composer's,
        odb.epoch.composer; None without one) in their place."""
        return {"arrived": self.arrived, "planned_final": self.planned_final, "window_index": self.window_index,
                "step": self.step, "optimizer_step": self.optimizer_step, **emitted, "composed": composed, "layers": self.layers, "stream": None,
                "step_tokens": None}

    def cut_stream(self, run: Dict[str, Any]) -> None:
        """Record in the run state ``run`` the latest restart point of the stream before every retained
        sample (nothing without a stream)."""
        if self.stream_marks is not None:
            position = run["position"]
            position["stream"] = self.stream_marks.cut(min(retained_positions(run), default=self.arrived))

    def load_state_dict(self, position: Dict[str, Any]) -> None:
        self.arrived = int(position["arrived"])
        self.planned_final = bool(position["planned_final"])
        self.window_index = int(position["window_index"])
        self.step = int(position["step"])
        self.optimizer_step = int(position["optimizer_step"])
        self.layers = [dict(layer) for layer in position["layers"]]
