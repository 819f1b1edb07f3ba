"""Where an epoch stands after one batch (the loader hands one out with every batch).

``odb.resume.state.cursor_state`` expands a cursor into the epoch's state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

from odb.epoch.stats import EpochStats


@dataclasses.dataclass(frozen=True)
class Cursor:
    """Where an epoch stands after one batch: the state after the last planned window, plus the
    steps emitted since and the counters then. Taking one costs O(1); ``cursor_state`` expands it.

    ``step_tokens``: (all ranks', this rank's) supervised tokens of the batch's optimizer step,
    when they are counted after planning (known lengths): a resume inside that step needs them.

    Example:
        >>> Cursor({"step": 4}, since=2, stats=EpochStats()).since
        2
    """

    snapshot: Dict[str, Any]
    since: int
    stats: EpochStats
    step_tokens: Optional[Tuple[int, int]] = None
