"""StepModel: a robust nonnegative linear model of a step's memory or seconds from its batch's shape."""

from __future__ import annotations

import json

import numpy as np
import pytest

from odb.plan.auto.nnls import nnls
from odb.plan.auto.step_model import FEATURES, StepModel, shape_features, window_features

# bytes per token, per token x length, per sample, constant; none per supervised token or image patch
TRUE = np.array([2.0e5, 150.0, 3.0e6, 4.0e9, 0.0, 0.0])


def _shapes(rng: np.random.Generator, n: int, packed: bool = False) -> np.ndarray:
    """(n, 6) features of random batches: B in [1, 64], lengths in [16, 4096]."""
    rows = []
    for _ in range(n):
        b = int(rng.integers(1, 65))
        lengths = rng.integers(16, 4097, size=b)
        rows.append(shape_features(lengths, packed))
    return np.array(rows)


def _fill(model: StepModel, feats: np.ndarray, values: np.ndarray) -> None:
    for f, v in zip(feats, values):
        model.observe(f, float(v))


def test_shape_features_padded_and_packed_literal():
    assert shape_features([3, 5, 4]).tolist() == [15.0, 75.0, 3.0, 1.0, 0.0, 0.0]
    assert shape_features([3, 5, 4], packed=True).tolist() == [12.0, 50.0, 3.0, 1.0, 0.0, 0.0]
    # (B, D): the first dimension only
    assert shape_features(np.array([[3, 100], [5, 100]])).tolist() == [10.0, 50.0, 2.0, 1.0, 0.0, 0.0]
    assert window_features([[2], [1, 3]], packed=True).tolist() == [[2.0, 4.0, 1.0, 1.0, 0.0, 0.0],
                                                                   [4.0, 10.0, 2.0, 1.0, 0.0, 0.0]]
    assert window_features([]).shape == (0, len(FEATURES))


@pytest.mark.parametrize("bad", [[], [-1, 3], [[[1]]]])
def test_shape_features_refuses_bad_lengths(bad):
    with pytest.raises(ValueError, match="Fix"):
        shape_features(bad)


def test_nnls_meets_the_kkt_conditions():
    rng = np.random.default_rng(3)
    for _ in range(50):
        a = rng.standard_normal((20, 4))
        y = rng.standard_normal(20)
        x = nnls(a, y)
        g = a.T @ (a @ x - y)
        assert (x >= 0).all()
        assert np.allclose(g[x > 0], 0.0, atol=1e-8)  # free coefficients: a stationary point
        assert (g[x == 0] >= -1e-8).all()  # bound ones: the objective would not fall by raising them


def test_noiseless_fit_recovers_the_coefficients():
    rng = np.random.default_rng(0)
    feats = _shapes(rng, 40)
    m = StepModel("memory")
    _fill(m, feats, feats @ TRUE)
    assert m.fitted
    got = np.array(list(m.coefficients().values()))
    np.testing.assert_allclose(got, TRUE, rtol=1e-6)
    assert m.relative_error() < 1e-9
    new = _shapes(rng, 10)
    np.testing.assert_allclose(m.predict(new), new @ TRUE, rtol=1e-9)


def test_noisy_fit_predicts_within_a_few_percent():
    rng = np.random.default_rng(1)
    feats = _shapes(rng, 400)
    m = StepModel("memory")
    _fill(m, feats, feats @ TRUE * (1 + 0.02 * rng.standard_normal(len(feats))))
    coef = m.coefficients()
    # the large terms are identified; the per-sample one (B x 3e6 against 4e9) is not, at 2% noise
    assert coef["tokens"] == pytest.approx(TRUE[0], rel=0.25)
    assert coef["square_tokens"] == pytest.approx(TRUE[1], rel=0.1)
    assert coef["constant"] == pytest.approx(TRUE[3], rel=0.05)
    new = _shapes(rng, 50)
    rel = np.abs(m.predict(new) / (new @ TRUE) - 1)
    assert rel.max() < 0.05 and rel.mean() < 0.015
    assert 0.005 < m.relative_error() < 0.03  # the median |residual| of 2% Gaussian noise is ~1.35%


def test_wild_outliers_are_ignored():
    rng = np.random.default_rng(2)
    feats = _shapes(rng, 60)
    values = feats @ TRUE
    values[[3, 17, 29, 41, 55]] *= np.array([10.0, 0.05, 7.0, 30.0, 0.2])
    m = StepModel("memory")
    _fill(m, feats, values)
    np.testing.assert_allclose(list(m.coefficients().values()), TRUE, rtol=1e-4)
    # 5 of 60 above or below: the 0.95 quantile of residuals may see one, the median none
    assert m.relative_error() < 1e-6


def test_coefficients_stay_nonnegative_when_the_truth_has_a_negative_term():
    rng = np.random.default_rng(4)
    feats = _shapes(rng, 80)
    values = feats @ np.array([2.0e5, 0.0, -5.0e6, 4.0e9, 0.0, 0.0])  # a "negative per-sample cost"
    assert (values > 0).all()
    m = StepModel("memory")
    _fill(m, feats, values)
    coef = np.array(list(m.coefficients().values()))
    assert (coef >= 0).all()
    assert coef[2] == 0.0
    assert (m.predict(_shapes(rng, 20)) >= 0).all()


def test_no_prediction_before_the_features_span_the_space():
    m = StepModel("memory")
    assert not m.fitted and m.predict(shape_features([8])) is None and m.upper(shape_features([8])) is None
    assert m.coefficients() is None and m.relative_error() is None
    for b in range(1, 11):  # one length only: tokens and square tokens move together, no fit
        f = shape_features([100] * b)
        m.observe(f, float(f @ TRUE))
    assert len(m) == 10 and not m.fitted and m.predict(shape_features([8])) is None
    rng = np.random.default_rng(5)
    for f in _shapes(rng, 5):
        m.observe(f, float(f @ TRUE))
    assert m.fitted and m.predict(shape_features([8])) == pytest.approx(float(shape_features([8]) @ TRUE))


def test_upper_bounds_the_points_it_was_fitted_on():
    rng = np.random.default_rng(6)
    feats = _shapes(rng, 300)
    values = feats @ TRUE * (1 + 0.03 * rng.standard_normal(len(feats)))
    m = StepModel("memory", floor=0.01, quantile=0.95)
    _fill(m, feats, values)
    up = m.upper(feats)
    pred = m.predict(feats)
    assert (up >= pred * 1.01).all()
    assert (values <= up).mean() >= 0.95
    assert m.upper_factor > 1.03  # 1 + the 0.95 quantile of 3% noise (~5%)
    # far beyond the shapes measured, the coefficients' uncertainty widens the bound
    far = shape_features([4096] * 2000)
    assert m.upper(far) / m.predict(far) > m.upper_factor + 1e-3


def test_old_points_are_forgotten_past_max_points():
    rng = np.random.default_rng(7)
    m = StepModel("seconds", max_points=50)
    feats = _shapes(rng, 200)
    _fill(m, feats[:100], feats[:100] @ (TRUE * 2))
    _fill(m, feats[100:], feats[100:] @ TRUE)
    assert len(m) == 50
    np.testing.assert_allclose(list(m.coefficients().values()), TRUE, rtol=1e-6)


def test_state_round_trip_through_json_gives_identical_predictions():
    rng = np.random.default_rng(8)
    feats = _shapes(rng, 100)
    a = StepModel("memory", max_points=64, floor=0.02, z=2.0)
    _fill(a, feats, feats @ TRUE * (1 + 0.02 * rng.standard_normal(len(feats))))
    b = StepModel("other")
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    new = _shapes(rng, 30)
    assert b.predict(new).tolist() == a.predict(new).tolist()
    assert b.upper(new).tolist() == a.upper(new).tolist()
    assert b.relative_error() == a.relative_error() and b.name == "memory" and b.max_points == 64
    a.observe(new[0], 5e9)
    b.observe(new[0], 5e9)  # refitted on the same points: the same fit
    assert b.predict(new).tolist() == a.predict(new).tolist()


def test_load_state_dict_refuses_a_foreign_dict():
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        StepModel("memory").load_state_dict({**StepModel("memory").state_dict(), "bogus": 1})


@pytest.mark.parametrize("features, value", [([1.0, 2.0, 3.0], 1.0), ([1.0, 1.0, 1.0, 1.0], -1.0),
                                             ([1.0, 1.0, 1.0, float("nan")], 1.0)])
def test_observe_refuses_bad_input(features, value):
    with pytest.raises(ValueError, match="Fix"):
        StepModel("memory").observe(features, value)


def test_constructor_refuses_too_few_points():
    with pytest.raises(ValueError, match="max_points=3"):
        StepModel("memory", max_points=3)
