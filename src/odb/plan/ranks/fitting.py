"""How one rank fits its planned groups to the step count every rank agreed on (pure).

Integers in, decisions out: the rank aligner (odb.epoch.ranks) exchanges the figures and
applies these decisions to its groups, the window planner's carry and the counters.

A window's fit runs in two stages:

1. ``decide_trim``: a rank with more groups than steps defers its least costly groups to
   the carry; a rank with fewer groups in the data's last window re-cuts them into
   similar ones (``rebalance``). Whatever is still missing comes from the carry.
2. ``decide_splits``: a rank still short splits its largest group in halves, again and
   again; once no group has two samples left, the missing steps are ghosts.

``must_emit`` says how many groups a rank cannot defer (its carry would outgrow a window),
``decide_window`` the step count and whether the ranks go on alone (``join=False``), and
``cost_rank_order`` ranks a rank's steps so that step k pairs groups of similar cost.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np

from odb.plan.ranks.align import decide_steps


@dataclasses.dataclass(frozen=True)
class WindowDecision:
    """What every rank does with a window, from the exchanged headers (the same on every rank).

    steps: steps every rank runs for the window (0 when ``go_local``).
    go_local: ``join=False`` and a rank's data ended: from here on every rank emits its own
        groups and stops when they end (no more exchanges).
    all_done: no rank has data left once this window's steps have run.
    """

    steps: int
    go_local: bool
    all_done: bool


def decide_window(n_groups: Sequence[int], must_emit: Sequence[int], exhausted: Sequence[bool],
                  join: bool, whole: bool = False) -> WindowDecision:
    """The window's step count over every rank's header (groups, groups it cannot defer, data ended).

    ``whole``: the window is one optimizer step (``global_batch_size``), which no rank may defer
    from: the count is the largest rank's, as at the data's end.

    Example:
        >>> decide_window([3, 2], [0, 0], [False, False], join=True)
        WindowDecision(steps=2, go_local=False, all_done=False)
        >>> decide_window([3, 2], [0, 0], [False, True], join=False).go_local
        True
        >>> decide_window([3, 2], [0, 0], [False, False], join=True, whole=True).steps
        3
    """
    ended = np.asarray(exhausted, dtype=bool)
    if not join and ended.any():
        return WindowDecision(0, True, False)
    steps = int(max(n_groups)) if whole else decide_steps(n_groups, must_emit, ended)
    return WindowDecision(steps, False, bool(ended.all()))


def must_emit(costs: Sequence[int], sizes: Sequence[int], tokens: Sequence[int], room: int,
              room_tokens: Optional[int]) -> int:
    """Groups a rank cannot defer: deferring its least costly groups, one by one, would take the
    carry past ``room`` more samples (or ``room_tokens`` more real tokens, when windows close at
    a token count; None: no token limit).

    Example:
        >>> must_emit([30, 10, 20], [3, 1, 2], [30, 10, 20], room=3, room_tokens=None)  # defers 10, 20
        1
        >>> must_emit([30, 10, 20], [3, 1, 2], [30, 10, 20], room=10, room_tokens=15)  # only 10 fits
        2
    """
    must = len(costs)
    for k in np.argsort(np.asarray(costs, dtype=np.float64), kind="stable").tolist():
        t = int(tokens[k]) if room_tokens is not None else 0
        if sizes[k] > room or (room_tokens is not None and t > room_tokens):
            break
        room -= int(sizes[k])
        if room_tokens is not None:
            room_tokens -= t
        must -= 1
    return must


@dataclasses.dataclass(frozen=True)
class TrimDecision:
    """Stage 1 of a rank's fit.

    keep: positions of the groups that run this window, in their order.
    defer: positions of the groups put back into the carry (ascending).
    rebalance: re-cut the kept groups into the window's step count (the data's last window).
    """

    keep: np.ndarray
    defer: np.ndarray
    rebalance: bool


def decide_trim(costs: Sequence[int], steps: int, planned_final: bool) -> TrimDecision:
    """Defer the least costly groups beyond ``steps`` (ties: the earlier group stays); in the data's
    last window, a rank with fewer groups than steps re-cuts them (no tiny tail, no halving).

    Example:
        >>> t = decide_trim([5, 9, 1, 7], 2, planned_final=False)   # defers the groups of cost 5 and 1
        >>> t.keep.tolist(), t.defer.tolist(), t.rebalance
        ([1, 3], [0, 2], False)
        >>> decide_trim([5], 3, planned_final=True).rebalance
        True
    """
    n = len(costs)
    order = np.argsort(np.asarray(costs, dtype=np.float64), kind="stable")
    defer = np.sort(order[:max(n - steps, 0)])
    keep = np.setdiff1d(np.arange(n), defer)
    return TrimDecision(keep, defer, bool(planned_final and steps > n and n > 0))


Piece = Tuple[int, int, int]  # (group, start, stop): the samples group[start:stop]


@dataclasses.dataclass(frozen=True)
class SplitDecision:
    """Stage 2 of a rank's fit: exactly ``steps`` step groups.

    pieces: the non-ghost step groups, as slices (group, start, stop) of the groups in hand.
    ghosts: ghost steps added after them (nothing left to split).
    splits: groups cut in halves.
    """

    pieces: Tuple[Piece, ...]
    ghosts: int
    splits: int

    def apply(self, groups: Sequence[np.ndarray]) -> List[Optional[np.ndarray]]:
        """The step groups (None: a ghost) cut from ``groups``."""
        out: List[Optional[np.ndarray]] = [groups[g][a:b] for g, a, b in self.pieces]
        return out + [None] * self.ghosts


def decide_splits(sizes: Sequence[int], steps: int) -> SplitDecision:
    """Split the largest group (the first of equal ones) into halves, the first half taking the odd
    sample, until there are ``steps`` groups; when no group has two samples, the rest are ghosts.
    Halves go to the end, in planner order (longest samples first), so both stay within budget.

    Example:
        >>> decide_splits([4, 2], 3)   # the 4 splits into 2 + 2
        SplitDecision(pieces=((1, 0, 2), (0, 0, 2), (0, 2, 4)), ghosts=0, splits=1)
        >>> decide_splits([1], 3)      # nothing to split: two ghosts
        SplitDecision(pieces=((0, 0, 1),), ghosts=2, splits=0)
    """
    pieces: List[Piece] = [(g, 0, int(n)) for g, n in enumerate(sizes)]
    splits = ghosts = 0
    while len(pieces) < steps:
        k = max(range(len(pieces)), key=lambda j: pieces[j][2] - pieces[j][1], default=None)
        if k is None or pieces[k][2] - pieces[k][1] < 2:
            ghosts = steps - len(pieces)
            break
        g, a, b = pieces.pop(k)
        mid = a + (b - a + 1) // 2
        pieces.extend([(g, a, mid), (g, mid, b)])
        splits += 1
    return SplitDecision(tuple(pieces), ghosts, splits)


def cost_rank_order(costs: Sequence[int], longest: Optional[Sequence[int]] = None) -> np.ndarray:
    """Positions of a rank's step groups by decreasing cost (ties: earlier first); with ``longest``
    (the worst-case probe's window) by decreasing longest sample first. Every rank ranks its own so,
    and step k pairs groups of similar cost across ranks. 2-D ``costs`` (and ``longest``): each row ranked,
    all in one sort (every replica's groups at once).

    Example:
        >>> cost_rank_order([10, 30, 20]).tolist()
        [1, 2, 0]
        >>> cost_rank_order([10, 30, 20], longest=[9, 5, 9]).tolist()
        [2, 0, 1]
        >>> cost_rank_order([[10, 30, 20], [5, 5, 7]]).tolist()
        [[1, 2, 0], [2, 0, 1]]
    """
    keys = [-np.asarray(costs, dtype=np.float64)]
    if longest is not None:
        keys.append(-np.asarray(longest, dtype=np.float64))
    return np.lexsort(keys) if np.size(costs) else np.zeros(np.shape(costs), dtype=np.int64)
