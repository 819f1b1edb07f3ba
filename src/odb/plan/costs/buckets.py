"""Shape buckets: the few padded lengths a batch may take, for compiled models (pure, numpy).

With ``ODBConfig(shape_buckets=...)`` every batch's padded length L is rounded up to the
smallest bucket that holds its longest sample, and the planner emits full batches of one
bucket (B = the samples of that length that fit the budget), so a compiled model sees a
few (B, L) shapes per epoch instead of one per step (docs/compile.md).

Example:
    >>> halving_buckets(16384, 4)
    (2048, 4096, 8192, 16384)
    >>> geometric_buckets(128, 2048, 5)
    (128, 256, 512, 1024, 2048)
    >>> bucket_length(700, (512, 1024, 2048))
    1024
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

Buckets = Tuple[int, ...]
_FIT_VALUES = 1024  # fit_buckets' candidate lengths: its m x m table stays at 8 MiB


def halving_buckets(budget: int, count: int, multiple: int = 1) -> Buckets:
    """``count`` lengths from ``budget`` down, halving each time (budget, budget/2, ...), each rounded down
    to ``multiple`` (at least ``multiple``), increasing, without repeats: what ``shape_buckets=count`` means.

    Example:
        >>> halving_buckets(10000, 3, multiple=8)
        (2496, 5000, 10000)
    """
    out = {max(multiple, (budget >> k) // multiple * multiple) for k in range(count)}
    return tuple(sorted(out))


def geometric_buckets(shortest: int, longest: int, count: int, multiple: int = 8) -> Buckets:
    """``count`` lengths spaced geometrically from ``shortest`` to ``longest`` (both included), each
    rounded up to ``multiple``: a grid for ``shape_buckets`` when the range of lengths is known (e.g. up to
    the tokenizer's ``max_length``). The ratio between neighbours sets the padding: a sample pads to the
    next bucket, so a ratio r costs up to 1 - 1/r of its tokens (about half that on average).

    Example:
        >>> geometric_buckets(100, 1000, 4, multiple=8)
        (104, 216, 472, 1000)
    """
    for name, value in (("shortest", shortest), ("longest", longest), ("count", count), ("multiple", multiple)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"geometric_buckets got {name}={value!r}: it must be a positive int. "
                             f"Fix: e.g. geometric_buckets(128, 2048, 6, multiple=8).")
    if shortest > longest:
        raise ValueError(f"geometric_buckets got shortest={shortest} > longest={longest}: the grid runs from the "
                         f"shortest bucket up to the longest. Fix: swap them.")
    if count == 1:
        points = np.array([float(longest)])
    else:
        points = np.geomspace(shortest, longest, count)
    return tuple(sorted({int(-(-int(np.ceil(p - 1e-9)) // multiple) * multiple) for p in points}))


def oversize_message(who: str, shown: object, longest: int, buckets: Sequence[int], budget: object,
                     found: str = "") -> str:
    """The error for a sample that no shape bucket holds within the budget (``oversize="error"``)."""
    return (f"{who} has length {shown}, and shape_buckets={tuple(buckets)} has no bucket that holds it within "
            f"token_budget={budget}{found} (a batch pads to the smallest bucket >= its longest sample). Rule: "
            f"oversize='error' refuses such samples. Fix: add a bucket >= {longest} (at most the budget), truncate "
            f"samples (e.g. tokenizer max_length), or pass oversize='alone' (own batch, its own shape) or 'skip'.")


def bucket_lengths(lengths: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
    """Each length rounded up to the smallest bucket that holds it; lengths above the largest bucket stay
    as they are (such a sample fits no bucket: the cost model treats it as oversize).

    Example:
        >>> bucket_lengths(np.array([[1], [64], [65], [300]]), (64, 128)).tolist()
        [[64], [64], [128], [300]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    grid = np.asarray(buckets, dtype=np.int64)
    at = np.searchsorted(grid, lengths, side="left")
    return np.where(at < len(grid), grid[np.minimum(at, len(grid) - 1)], lengths)


def bucket_length(length: int, buckets: Optional[Sequence[int]]) -> int:
    """The padded length of a batch whose longest sample (already padded to ``pad_to_multiple_of``) has
    ``length`` tokens: the smallest bucket that holds it (``length`` itself above the largest bucket or
    without buckets). A collate that pads by itself pads each batch to this (``cfg.shape_buckets``).

    Example:
        >>> bucket_length(65, (64, 128)), bucket_length(65, None)
        (128, 65)
    """
    if not buckets:
        return int(length)
    return int(bucket_lengths(np.array([int(length)]), buckets)[0])


def fit_buckets(lengths: Sequence[int], count: int, multiple: int = 8, budget: Optional[int] = None) -> Buckets:
    """The ``count`` bucket lengths that pad these lengths least (each rounded up to ``multiple``; the largest
    bucket holds the longest): for ``shape_buckets`` from a sample of the data's lengths (or ``lengths=``).

    Exact: a dynamic program over the distinct rounded lengths minimises the padded tokens, sum over
    samples of their bucket's length; with ``budget``, of the budget's share each sample takes in a full
    batch of its bucket, ``budget / floor(budget / bucket)`` (so a bucket just above budget / 3 is avoided:
    its batches hold 2 samples and leave a third of the budget unused). It runs in O(count x m^2) numpy work for m distinct rounded lengths;
    above 1,024 of them the lengths are rounded to 2, 4, ... times ``multiple`` first.

    Example:
        >>> fit_buckets([10, 11, 12, 100, 101], 2, multiple=1)
        (12, 101)
        >>> fit_buckets([30, 34, 40], 2, multiple=1, budget=100), fit_buckets([30, 34, 40], 2, multiple=1)
        ((30, 40), (34, 40))
    """
    if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
        raise ValueError(f"fit_buckets got count={count!r}: it must be a positive int. Fix: e.g. count=6.")
    values = np.asarray(lengths, dtype=np.int64).reshape(-1)
    if not len(values) or values.min() < 1:
        raise ValueError(f"fit_buckets got {len(values)} lengths (smallest {values.min() if len(values) else None}): "
                         f"it needs at least one positive length. Fix: pass the lengths of (a sample of) the data.")
    step = multiple
    while True:  # at most _FIT_VALUES distinct candidates (a coarser step keeps them multiples of ``multiple``)
        rounded = -(-values // step) * step
        u, c = np.unique(rounded, return_counts=True)
        if len(u) <= _FIT_VALUES:
            break
        step *= 2
    m = len(u)
    if m <= count:
        return tuple(int(v) for v in u)
    cum = np.concatenate(([0], np.cumsum(c))).astype(np.float64)  # cum[j]: samples below u[j]
    top = u.astype(np.float64)
    if budget is not None:
        if np.any(u > budget):
            raise ValueError(f"fit_buckets got budget={budget} but lengths up to {int(u[-1])}: a sample longer "
                             f"than the budget fits no batch. Fix: raise budget, or truncate the samples.")
        top = budget / np.floor(budget / top)
    # best[j]: least padded tokens of the samples up to u[j] with at most k + 1 buckets, the largest u[j];
    # parent[k, j]: the next bucket below u[j] at level k (-1: level k adds nothing over level k - 1).
    best = top * cum[1:]
    parent = np.full((count, m), -1, dtype=np.int64)
    lower = np.tril(np.ones((m, m), dtype=bool))  # i >= j: not a bucket below u[j]
    for k in range(1, count):
        cand = best[:, None] + top[None, :] * (cum[None, 1:] - cum[1:, None])
        cand[lower] = np.inf
        below = cand.argmin(axis=0)
        value = cand[below, np.arange(m)]
        better = value < best
        parent[k] = np.where(better, below, -1)
        best = np.where(better, value, best)
    out, j = [int(u[-1])], m - 1
    for k in range(count - 1, 0, -1):
        i = int(parent[k, j])
        if i >= 0:
            out.append(int(u[i]))
            j = i
    return tuple(sorted(out))
