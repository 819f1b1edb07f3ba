"""Token-budget schedules over optimizer steps (plain data, so resume stays exact)."""

from __future__ import annotations

from typing import Sequence, Tuple

Schedule = Tuple[Tuple[int, int], ...]


def budget_at(schedule: Schedule, optimizer_step: int) -> int:
    """The budget in force at ``optimizer_step``: the last pair whose step is <= it.

    Example:
        >>> budget_at(((0, 4096), (100, 16384)), 99), budget_at(((0, 4096), (100, 16384)), 100)
        (4096, 16384)
    """
    budget = schedule[0][1]
    for step, value in schedule:
        if step > optimizer_step:
            break
        budget = value
    return budget


def linear_budget_ramp(start: int, end: int, steps: int, points: int = 10) -> Schedule:
    """A warm-up from ``start`` to ``end`` tokens over ``steps`` optimizer steps, in ``points`` stairs.

    Example:
        >>> linear_budget_ramp(4096, 16384, 100, points=4)
        ((0, 4096), (25, 7168), (50, 10240), (75, 13312), (100, 16384))
    """
    if points < 1 or steps < points:
        raise ValueError(f"linear_budget_ramp got steps={steps}, points={points}: need 1 <= points <= steps. "
                         f"Fix: use fewer points or a longer ramp.")
    return tuple((steps * k // points, start + (end - start) * k // points) for k in range(points + 1))


def check_schedule(schedule: Sequence[Sequence[int]]) -> Schedule:
    """Validate a schedule: pairs (optimizer_step, budget), from step 0, steps increasing, budgets > 0."""
    try:
        pairs = tuple((int(s), int(b)) for s, b in schedule)
    except (TypeError, ValueError):
        pairs = ()
    ok = bool(pairs) and pairs[0][0] == 0 and all(b > 0 for _, b in pairs) and \
        all(a[0] < b[0] for a, b in zip(pairs, pairs[1:]))
    if not ok:
        raise ValueError(f"ODBConfig.budget_schedule={schedule!r}: must be (optimizer_step, token_budget) pairs "
                         f"starting at step 0 with increasing steps and positive budgets. Fix: e.g. "
                         f"budget_schedule=odb.linear_budget_ramp(4096, 16384, steps=500).")
    return pairs
