"""The features of one batch that ``odb.plan.auto.step_model.StepModel`` fits a step's memory or seconds on
(``FEATURES``; what each means and when it matters: that module's docstring, docs/cost-model.md). Pure numpy.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

FEATURES = ("tokens", "square_tokens", "samples", "constant", "supervised_tokens", "image_patches")

N_FEATURES = len(FEATURES)
N_SHAPE = 4  # tokens, square_tokens, samples, constant: always fitted; the others when the points identify them


def shape_features(lengths: Any, packed: bool = False, supervised: Any = None, patches: Any = None) -> np.ndarray:
    """The (6,) features of one batch (``FEATURES``) from its samples' lengths, supervised tokens and
    image patches (per sample or summed; None: 0).

    ``lengths`` is (B,) or (B, D); with several length dimensions the first is used.

    Example:
        >>> shape_features([3, 5]).tolist()            # padded: 2 x 5 tokens, 2 x 25 squared
        [10.0, 50.0, 2.0, 1.0, 0.0, 0.0]
        >>> shape_features([[3, 1], [5, 1]], packed=True, supervised=[2, 4], patches=[16, 0]).tolist()
        [8.0, 34.0, 2.0, 1.0, 6.0, 16.0]
    """
    arr = np.asarray(lengths, dtype=np.float64)
    if arr.ndim == 2:
        arr = arr[:, 0]
    if arr.ndim != 1 or len(arr) == 0:
        raise ValueError(
            f"lengths of shape {np.shape(lengths)}: a batch's features need its samples' lengths as a "
            f"non-empty (B,) or (B, D) array. Fix: pass the lengths of the batch's samples.")
    if (arr < 0).any() or not np.isfinite(arr).all():
        raise ValueError(
            f"lengths {arr.tolist()[:8]}: a length must be a finite number >= 0. Fix: pass measured lengths.")
    b = float(len(arr))
    sup, pat = _total(supervised, "supervised"), _total(patches, "patches")
    if packed:
        return np.array([arr.sum(), (arr * arr).sum(), b, 1.0, sup, pat])
    top = float(arr.max())
    return np.array([b * top, b * top * top, b, 1.0, sup, pat])


def _total(counts: Any, what: str) -> float:
    if counts is None:
        return 0.0
    total = float(np.sum(np.asarray(counts, dtype=np.float64)))
    if not math.isfinite(total) or total < 0:
        raise ValueError(f"{what} counts {counts!r}: a batch's {what} must be finite counts >= 0. Fix: pass the "
                         f"samples' measured counts (or None).")
    return total


def window_features(groups: Sequence[Any], packed: bool = False) -> np.ndarray:
    """(n, 6) features of n batches, one row each (``shape_features`` of each group's lengths).

    Example:
        >>> window_features([[3, 5], [8]]).tolist()
        [[10.0, 50.0, 2.0, 1.0, 0.0, 0.0], [8.0, 64.0, 1.0, 1.0, 0.0, 0.0]]
    """
    if len(groups) == 0:
        return np.zeros((0, N_FEATURES))
    return np.stack([shape_features(g, packed) for g in groups])


def as_features(features: Any) -> np.ndarray:
    """Checked (6,) or (n, 6) features; (..., 4) shape features alone (as saved before the supervised-token and
    patch features) get zeros for those.

    Example:
        >>> as_features([10.0, 100.0, 1.0, 1.0]).tolist()
        [10.0, 100.0, 1.0, 1.0, 0.0, 0.0]
    """
    f = np.asarray(features, dtype=np.float64)
    if f.shape[-1:] == (N_SHAPE,):  # the four shape features alone (a state saved before the others): none of those
        f = np.concatenate((f, np.zeros(f.shape[:-1] + (N_FEATURES - N_SHAPE,))), axis=-1)
    if f.shape[-1:] != (N_FEATURES,) or f.ndim > 2 or not np.isfinite(f).all() or (f < 0).any():
        raise ValueError(
            f"features of shape {f.shape}: a step model takes {N_FEATURES} finite nonnegative features "
            f"{FEATURES} per batch. Fix: build them with odb.plan.auto.step_model.shape_features(lengths).")
    return f
