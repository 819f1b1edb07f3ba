"""Nonnegative least squares for the few columns of odb's step models (odb.plan.auto.step_model):
argmin ||a x - y|| over x >= 0. Pure numpy.

Example:
    >>> import numpy as np
    >>> nnls(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([2.0, -1.0])).tolist()
    [2.0, 0.0]
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["nnls"]


def nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||a x - y|| over x >= 0 (Lawson and Hanson's active set: a handful of least-squares
    solves where trying every support costs 2^n - 1 of them); every support is tried instead when
    the active set does not settle (degenerate data).

    Example:
        >>> nnls(np.array([[1.0, 0.0], [0.0, 1.0]]), np.array([2.0, -1.0])).tolist()
        [2.0, 0.0]
    """
    n_cols = a.shape[1]
    x = np.zeros(n_cols)
    free = np.zeros(n_cols, dtype=bool)
    tol = 10.0 * np.finfo(float).eps * max(float(np.abs(a).sum(axis=0).max(initial=0.0)), 1e-300) * max(a.shape)
    for _ in range(3 * n_cols + 3):
        w = a.T @ (y - a @ x)
        if free.all() or not (w[~free] > tol).any():
            return x
        free[int(np.argmax(np.where(free, -np.inf, w)))] = True
        for _ in range(3 * n_cols + 3):
            z = np.zeros(n_cols)
            z[free] = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
            if (z[free] > 0).all():
                break
            out = free & (z <= 0)  # step from x towards z until the first free coefficient reaches 0
            alpha = float(np.min(x[out] / np.maximum(x[out] - z[out], 1e-300)))
            x = x + alpha * (z - x)
            free &= x > tol
            x[~free] = 0.0
        else:
            return _nnls_by_supports(a, y)
        x = z
    return _nnls_by_supports(a, y)


def _nnls_by_supports(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """argmin ||a x - y|| over x >= 0, exactly, for a few columns: the best unconstrained fit over
    every support whose coefficients are all nonnegative (the optimum is one of them)."""
    n_cols = a.shape[1]
    best, best_ssr = np.zeros(n_cols), float(y @ y)
    for cols in itertools.chain.from_iterable(itertools.combinations(range(n_cols), r) for r in range(1, n_cols + 1)):
        idx = list(cols)
        sol = np.linalg.lstsq(a[:, idx], y, rcond=None)[0]
        if (sol < 0).any():
            continue
        r = a[:, idx] @ sol - y
        ssr = float(r @ r)
        if ssr < best_ssr * (1 - 1e-12) or (ssr <= best_ssr and len(idx) < np.count_nonzero(best)):
            best = np.zeros(n_cols)
            best[idx] = sol
            best_ssr = ssr
    return best
