"""A model of one training step fitted online: peak memory or seconds from a batch's shape (pure numpy).

A step's cost is modelled as a nonnegative linear function of six features of its batch
(``FEATURES``)::

    value ~ a * tokens + b * square_tokens + c * samples + d + e * supervised_tokens + f * image_patches

Padded, a batch of B samples whose longest has length L holds ``tokens = B * L`` and
``square_tokens = B * L**2`` (attention without a fused kernel is quadratic in L); packed
(one row of samples end to end), ``tokens = sum L`` and ``square_tokens = sum L**2``.
``samples = B`` and ``constant = 1`` (weights, optimizer state, the allocator's reserve).
``supervised_tokens`` is the sum over the batch's samples of their supervised tokens (labels !=
ignore_index): a plain cross-entropy materializes logits for every token (``a`` holds them, about
vocabulary x bytes per token), a chunked or fused loss (TRL's fused LM head, Liger's fused linear
cross-entropy) only for the supervised ones (``e`` holds them). ``image_patches`` is the sum of the
samples' image patches (the vision tower's activations; 0 without images).

A feature that no point sets (no images), or that the points kept cannot tell apart from the
others (every token supervised in packed rows: ``supervised_tokens == tokens``), is left out of
the fit (coefficient 0): what it would cost is then carried by the features it moved with.

``StepModel`` keeps the last ``max_points`` observations and fits the coefficients by
least squares on *relative* residuals (a batch twice as large weighs the same), exactly
nonnegative (the NNLS of a few variables is solved over every support), robust to outliers
(iteratively reweighted with Huber weights, points beyond 3 robust sigmas dropped).
``upper`` is the conservative bound the memory planner uses: the prediction times
``1 + `` a high quantile of the relative residuals (at least ``floor``), plus ``z`` standard
errors of the prediction from the coefficients' own uncertainty. That last term is small
among the shapes observed and grows with the distance beyond them, so a bound far from the
data (a budget many times the one measured) stays safe while noisy points are few.

The features come from the lengths the model actually runs on: pass padded lengths
(after ``pad_to_multiple_of``, buckets) when the collate pads to them.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

import numpy as np

from odb.plan.auto.step_features import FEATURES, N_FEATURES as _N, N_SHAPE as _BASE, as_features as _as_features
from odb.plan.auto.step_features import shape_features, window_features
from odb.plan.auto.nnls import nnls

__all__ = ["FEATURES", "StepModel", "shape_features", "window_features"]

_MIN_POINTS = 6
_RANK_TOL = 1e-9  # smallest singular value / largest of the column-scaled design: below it, not identified
# A further feature is fitted only when at least this share of it (relative norm) is not a combination of the
# features already fitted: a feature that moved almost in step with them leaves the split of the cost unknown, and
# a fit that split it wrongly would underestimate the batches where they part (a tiny HF Llama whose supervised
# tokens were 60% of its tokens in every batch: 1.4% unexplained, a fit all on supervised tokens, 1.2x the cap).
_NEW_FEATURE_SHARE = 0.05
_STATE_KEYS = ("name", "max_points", "floor", "quantile", "z", "features", "values", "coef", "covariance",
               "upper_factor", "relative_error")


def _covariance(xs: np.ndarray, ys: np.ndarray, weights: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """The coefficients' covariance in the scaled problem: the weighted residual variance times the
    inverse normal matrix of all the fitted columns (a coefficient held at 0 may still be uncertain: two
    features that moved together in the points kept leave their split unknown, and that must widen
    the bound where they part)."""
    n_cols = xs.shape[1]
    used = weights > 0
    dof = int(used.sum()) - n_cols
    if dof <= 0:
        return np.zeros((n_cols, n_cols))
    r = xs @ coef - ys
    sigma2 = float((weights * r * r).sum()) / dof
    z = xs * np.sqrt(weights)[:, None]
    return sigma2 * np.linalg.pinv(z.T @ z)


class StepModel:
    """One target of a training step (peak memory bytes, or seconds) as a nonnegative linear function
    of a batch's features, fitted online.

    Args:
        name: what it models (shown in metrics and errors).
        max_points: the most recent observations kept.
        floor: the least relative margin of ``upper`` over ``predict``.
        quantile: the quantile of the relative residuals that ``upper`` adds.
        z: standard errors of the prediction (from the coefficients' uncertainty) that ``upper`` adds.

    Example:
        >>> m = StepModel("memory")
        >>> for b, l, s in [(4, 10, 3), (2, 30, 25), (8, 5, 1), (1, 60, 10), (3, 20, 20), (6, 12, 4), (5, 7, 7)]:
        ...     f = shape_features([l] * b, supervised=[s] * b)   # no images: image_patches stays out
        ...     m.observe(f, 2.0 * f[0] + 0.01 * f[1] + 5.0 * f[2] + 100.0 + 3.0 * f[4])
        >>> {k: round(v, 6) for k, v in m.coefficients().items()}
        {'tokens': 2.0, 'square_tokens': 0.01, 'samples': 5.0, 'constant': 100.0, 'supervised_tokens': 3.0, 'image_patches': 0.0}
        >>> round(m.predict(shape_features([10, 10], supervised=[4, 6])), 6)
        182.0
    """

    def __init__(self, name: str, max_points: int = 512, *, floor: float = 0.01, quantile: float = 0.95,
                 z: float = 3.0) -> None:
        if int(max_points) < _MIN_POINTS:
            raise ValueError(
                f"max_points={max_points!r}: a step model needs at least {_MIN_POINTS} points to fit "
                f"{_BASE} coefficients robustly. Fix: pass max_points >= {_MIN_POINTS} (default 512).")
        if not (0.0 <= floor < 10.0) or not (0.5 <= quantile <= 1.0) or not (0.0 <= z < 100.0):
            raise ValueError(
                f"floor={floor!r}, quantile={quantile!r}, z={z!r}: the upper bound's margin must be in [0, 10), its "
                f"quantile in [0.5, 1] and its standard errors z in [0, 100). Fix: pass e.g. floor=0.01, "
                f"quantile=0.95, z=3.")
        self.name = str(name)
        self.max_points = int(max_points)
        self.floor = float(floor)
        self.quantile = float(quantile)
        self.z = float(z)
        self._x: List[List[float]] = []
        self._y: List[float] = []
        self._coef: Optional[np.ndarray] = None
        self._cov = np.zeros((_N, _N))
        self._upper = 1.0 + self.floor
        self._rel_error: Optional[float] = None
        self._dirty = False

    def observe(self, features: Any, value: float) -> None:
        """Add one step: its batch's features and the measured value (>= 0).

        Example:
            >>> m = StepModel("seconds"); m.observe(shape_features([4, 4]), 0.25); len(m)
            1
        """
        f = _as_features(features)
        v = float(value)
        if f.ndim != 1 or not math.isfinite(v) or v < 0:
            raise ValueError(
                f"{self.name}: observed value {value!r} for features of shape {f.shape}: one batch's (6,) "
                f"features and a finite value >= 0 are needed. Fix: pass shape_features(lengths) and the "
                f"measured {self.name}.")
        self._x.append([float(t) for t in f])
        self._y.append(v)
        if len(self._y) > self.max_points:
            del self._x[0], self._y[0]
        self._dirty = True

    def __len__(self) -> int:
        return len(self._y)

    def points(self) -> np.ndarray:
        """(n, 4) features of the observations kept, oldest first.

        Example:
            >>> m = StepModel("memory"); m.observe(shape_features([2, 3]), 1.0); m.points().tolist()
            [[6.0, 18.0, 2.0, 1.0, 0.0, 0.0]]
        """
        return np.asarray(self._x, dtype=np.float64).reshape(-1, _N)

    @staticmethod
    def _well_posed(x: np.ndarray) -> bool:
        if len(np.unique(x, axis=0)) < x.shape[1]:
            return False
        scale = np.abs(x).max(axis=0)
        if (scale <= 0).any():
            return False
        s = np.linalg.svd(x / scale, compute_uv=False)
        return bool(s[-1] > _RANK_TOL * s[0])

    def _columns(self, x: np.ndarray) -> Optional[List[int]]:
        """The features fitted on these points: the four shape features (None when they do not span their
        directions: not fitted), and each further feature that the points set and tell apart from those
        (at least ``_NEW_FEATURE_SHARE`` of it not a combination of them)."""
        if len(x) < _MIN_POINTS or not self._well_posed(x[:, :_BASE]):
            return None
        cols = list(range(_BASE))
        for k in range(_BASE, _N):
            if not self._well_posed(x[:, cols + [k]]):
                continue
            xs = x[:, cols + [k]] / np.abs(x[:, cols + [k]]).max(axis=0)
            rest = xs[:, -1] - xs[:, :-1] @ np.linalg.lstsq(xs[:, :-1], xs[:, -1], rcond=None)[0]
            if np.linalg.norm(rest) >= _NEW_FEATURE_SHARE * np.linalg.norm(xs[:, -1]):
                cols.append(k)
        return cols

    def fit(self) -> bool:
        """Fit the coefficients on the points kept; returns whether the model is fitted (enough points,
        features whose four shape directions are spanned). Called lazily by the predictions.

        Example:
            >>> m = StepModel("memory"); m.observe(shape_features([4]), 10.0); m.fit()
            False
        """
        self._dirty = False
        full = np.asarray(self._x, dtype=np.float64).reshape(-1, _N)
        y = np.asarray(self._y, dtype=np.float64)
        cols = self._columns(full)
        if cols is None:
            self._coef, self._upper, self._rel_error = None, 1.0 + self.floor, None
            self._cov = np.zeros((_N, _N))
            return False
        x = full[:, cols]
        n_cols = len(cols)
        scale = np.abs(x).max(axis=0)
        xn = x / scale  # columns of comparable size; coefficients in these units until the end
        previous = None if self._coef is None else self._coef[cols] * scale
        coef_s = self._robust_start(xn, y, previous)
        weights = np.ones(len(y))
        rows = np.ones(len(y))
        for _ in range(20):
            # Least squares on residuals relative to the current prediction (not to the value: a wild
            # low value must not weigh more), Huber-weighted, points beyond 3 robust sigmas dropped.
            pred = xn @ coef_s
            rows = 1.0 / np.maximum(pred, 1e-12 * max(float(np.median(pred)), 1e-300))
            r = (y - pred) * rows
            sigma = max(1.4826 * float(np.median(np.abs(r - np.median(r)))), 1e-9)
            k, a = 1.345 * sigma, np.abs(r)
            weights = np.where(a <= k, 1.0, k / np.maximum(a, 1e-300))
            weights[a > 3.0 * sigma] = 0.0
            if np.count_nonzero(weights) < n_cols:
                weights = np.ones(len(y))
            sw = rows * np.sqrt(weights)
            new = nnls(xn * sw[:, None], y * sw)
            done = np.allclose(new, coef_s, rtol=1e-10, atol=1e-14 * max(float(np.abs(new).max()), 1e-300))
            coef_s = new
            if done:
                break
        xs, ys = xn * rows[:, None], y * rows
        self._coef = np.zeros(_N)
        self._coef[cols] = np.maximum(coef_s / scale, 0.0)
        self._cov = np.zeros((_N, _N))
        self._cov[np.ix_(cols, cols)] = _covariance(xs, ys, weights, coef_s) / np.outer(scale, scale)
        pred = full @ self._coef
        rel = y / np.maximum(pred, 1e-300) - 1.0
        self._upper = 1.0 + max(self.floor, float(np.quantile(rel, self.quantile)))
        self._rel_error = float(np.median(np.abs(rel)))
        return True

    @staticmethod
    def _robust_start(xn: np.ndarray, y: np.ndarray, previous: Optional[np.ndarray]) -> np.ndarray:
        """A first fit that outliers do not drag (least median of squares): of the fit on every point,
        the previous fit and fits on 40 small subsets (seeded by the point count: the same points give
        the same start), the one whose median absolute relative residual is least."""
        inv = 1.0 / np.maximum(y, 1e-12 * max(float(y.max()), 1e-300))
        xs, ys = xn * inv[:, None], y * inv
        candidates = [nnls(xs, ys)] + ([] if previous is None else [previous])
        rng = np.random.default_rng(len(y))
        size = min(len(y), 2 * xn.shape[1])
        for _ in range(40):
            pick = rng.choice(len(y), size=size, replace=False)
            candidates.append(nnls(xs[pick], ys[pick]))
        scores = np.array([float(np.median(np.abs(xs @ c - ys))) for c in candidates])
        return candidates[int(np.flatnonzero(scores <= scores.min() + 1e-9)[0])]  # ties: the fit on every point

    def _ensure(self) -> None:
        if self._dirty:
            self.fit()

    @property
    def fitted(self) -> bool:
        """Whether predictions are available (enough points spanning the features).

        Example:
            >>> StepModel("memory").fitted
            False
        """
        self._ensure()
        return self._coef is not None

    def predict(self, features: Any) -> Optional[float]:
        """The modelled value of a batch (a float; (n,) array for (n, 4) features), None before fitted.

        Example:
            >>> print(StepModel("memory").predict(shape_features([4])))
            None
        """
        self._ensure()
        if self._coef is None:
            return None
        f = _as_features(features)
        out = f @ self._coef
        return float(out) if f.ndim == 1 else out

    @property
    def upper_factor(self) -> float:
        """``upper / predict``: 1 + the residuals' high quantile (at least ``floor``).

        Example:
            >>> StepModel("memory", floor=0.05).upper_factor
            1.05
        """
        self._ensure()
        return self._upper

    def upper(self, features: Any) -> Optional[float]:
        """A conservative bound: the prediction times ``upper_factor``; None before fitted.

        Example:
            >>> print(StepModel("memory").upper(shape_features([4])))
            None
        """
        p = self.predict(features)
        if p is None:
            return None
        f = _as_features(features)
        var = np.einsum("...i,ij,...j->...", f, self._cov, f)
        out = p * self._upper + self.z * np.sqrt(np.maximum(var, 0.0))
        return float(out) if f.ndim == 1 else out

    def coefficients(self) -> Optional[Dict[str, float]]:
        """The fitted coefficients by feature name (None before fitted).

        Example:
            >>> print(StepModel("memory").coefficients())
            None
        """
        self._ensure()
        return None if self._coef is None else {k: float(v) for k, v in zip(FEATURES, self._coef)}

    def relative_error(self) -> Optional[float]:
        """The median absolute relative residual of the points kept (None before fitted).

        Example:
            >>> print(StepModel("memory").relative_error())
            None
        """
        self._ensure()
        return self._rel_error

    def state_dict(self) -> Dict[str, Any]:
        """Plain data (lists and floats, JSON-able) restoring the same points and predictions.

        Example:
            >>> sorted(StepModel("memory").state_dict())[:3]
            ['coef', 'covariance', 'features']
        """
        self._ensure()
        return {
            "name": self.name,
            "max_points": self.max_points,
            "floor": self.floor,
            "quantile": self.quantile,
            "z": self.z,
            "features": [list(r) for r in self._x],
            "values": list(self._y),
            "coef": None if self._coef is None else [float(v) for v in self._coef],
            "covariance": [[float(v) for v in row] for row in self._cov],
            "upper_factor": self._upper,
            "relative_error": self._rel_error,
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (the fit is restored as saved, not refitted).

        Example:
            >>> a = StepModel("memory"); a.observe(shape_features([4]), 9.0)
            >>> b = StepModel("memory"); b.load_state_dict(a.state_dict()); len(b)
            1
        """
        missing = [k for k in _STATE_KEYS if k not in state]
        unknown = [k for k in state if k not in _STATE_KEYS]
        if missing or unknown:
            raise ValueError(
                f"step model state with missing keys {missing} and unknown keys {unknown}: a StepModel loads only "
                f"what its state_dict() saved. Fix: pass the dict StepModel.state_dict() returned.")
        self.name = str(state["name"])
        self.max_points = int(state["max_points"])
        self.floor = float(state["floor"])
        self.quantile = float(state["quantile"])
        self.z = float(state["z"])
        self._x = [[float(t) for t in _as_features(r)] for r in state["features"]]
        self._y = [float(v) for v in state["values"]]
        self._coef = None if state["coef"] is None else _as_features(np.asarray(state["coef"], dtype=np.float64))
        cov = np.asarray(state["covariance"], dtype=np.float64)
        self._cov = np.zeros((_N, _N))
        k = int(round(math.sqrt(cov.size)))  # 4 x 4 in a state saved before the further features
        self._cov[:k, :k] = cov.reshape(k, k)
        self._upper = float(state["upper_factor"])
        self._rel_error = None if state["relative_error"] is None else float(state["relative_error"])
        self._dirty = False
