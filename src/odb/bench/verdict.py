"""A goal's verdict against the run-to-run spread: met, not met, or within the spread (the rounds' min-max
of the measured ratio straddles the target, so another run could turn the verdict).

The spread of a ratio comes from the rounds themselves where they pair up (the same round of both arms),
else from the arms' own min-max (the widest ratio those allow: it never narrows a baseline's spread).

Example:
    >>> [round(x, 3) for x in ratio_spread({"median": 10, "min": 9, "max": 11}, {"median": 5, "min": 4.5, "max": 5.5})]
    [1.636, 2.444]
    >>> straddles((0.9, 1.1), 1.0), straddles((1.05, 1.1), 1.0)
    (True, False)
    >>> verdict(True, False), verdict(True, True), verdict(False, True)
    ('met', 'met (spread straddles)', 'NOT MET (spread straddles)')
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Sequence, Tuple

__all__ = ["paired_spread", "ratio_spread", "spread_text", "straddles", "verdict"]

Spread = Tuple[float, float]


def ratio_spread(a: Dict[str, float], b: Dict[str, float]) -> Optional[Spread]:
    """The widest ratio a / b that two arms' min-max allow: (a's min / b's max, a's max / b's min)."""
    try:
        lo, hi = a["min"] / b["max"], a["max"] / b["min"]
    except (KeyError, TypeError, ZeroDivisionError):
        return None
    return (lo, hi)


def paired_spread(pairs: Iterable[Tuple[Optional[float], Optional[float]]]) -> Optional[Spread]:
    """min-max of a / b over rounds (each pair one round of both arms); None when a round lacks either.

    Example:
        >>> paired_spread([(2.0, 4.0), (3.0, 4.0)]), paired_spread([(2.0, None)])
        ((0.5, 0.75), None)
    """
    ratios = []
    for a, b in pairs:
        if a is None or b is None or b <= 0:
            return None
        ratios.append(a / b)
    return (min(ratios), max(ratios)) if ratios else None


def straddles(spread: Optional[Sequence[float]], target: Optional[float]) -> bool:
    """Whether the target lies strictly inside the spread (the verdict could turn from run to run)."""
    if spread is None or target is None:
        return False
    return spread[0] < target < spread[1]


def spread_text(spread: Optional[Sequence[float]], spec: str = "{:.2f}") -> str:
    """' (rounds: lo-hi)', or '' without a spread."""
    return "" if spread is None else f" (rounds: {spec.format(spread[0])}-{spec.format(spread[1])})"


def verdict(met: Optional[bool], straddle: bool) -> str:
    """The verdict column: met / NOT MET by the median, and whether the rounds' spread straddles the target."""
    if met is None:
        return "-"
    return ("met" if met else "NOT MET") + (" (spread straddles)" if straddle else "")
