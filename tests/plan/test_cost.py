"""CostModel on small hand-computed examples."""

from __future__ import annotations

import numpy as np
import pytest

from odb.config import ODBConfig
from odb.plan.costs.cost import CostModel

INT_MAX = np.iinfo(np.int64).max


def col(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)[:, None]


def test_pad_rounds_up_to_the_multiple() -> None:
    assert CostModel((100,), pad_to_multiple_of=8).pad(col(1, 8, 9, 16, 17)).ravel().tolist() == [8, 8, 16, 16, 24]
    assert CostModel((100,)).pad(col(1, 9)).ravel().tolist() == [1, 9]


@pytest.mark.parametrize("model, group, expected", [
    (CostModel((100,)), col(10, 3), 20.0),                                  # 2 x 10
    (CostModel((100,), pad_to_multiple_of=8), col(10, 3), 32.0),            # 2 x 16 (docstring example)
    (CostModel((100,)), col(7), 7.0),
    (CostModel((100,)), np.array([[10, 20], [30, 5]]), 100.0),              # 2 x (30 + 20)
    (CostModel((100, 100)), np.array([[10, 20], [30, 5], [1, 1]]), 150.0),  # 3 x (30 + 20)
    (CostModel((1000,), quadratic_length=100), col(50, 10, 20), 225.0),     # 3 x 50 x (1 + 0.5)
    (CostModel((10**6,), quadratic_length=64), np.array([[64, 32]]), 128.0 + 48.0),
])
def test_batch_cost(model: CostModel, group: np.ndarray, expected: float) -> None:
    assert model.batch_cost(model.pad(group)) == pytest.approx(expected)


def test_token_weight() -> None:
    assert CostModel((1,)).token_weight(col(3)).ravel().tolist() == [3.0]
    assert CostModel((1,), quadratic_length=4).token_weight(col(2, 4)).ravel().tolist() == [3.0, 8.0]


@pytest.mark.parametrize("model, padded, patches, expected", [
    (CostModel((100,)), col(10, 30, 101, 50, 100), None, [10, 3, 0, 2, 1]),
    (CostModel((100,), max_batch_size=4), col(10, 30, 101, 50), None, [4, 3, 0, 2]),
    (CostModel((100,), batch_size_multiple=4), col(10, 30, 101, 50, 5), None, [8, 3, 0, 2, 20]),
    (CostModel((100,), max_batch_size=4, batch_size_multiple=4), col(10, 30), None, [4, 3]),
    (CostModel((100,)), np.array([[10, 10], [60, 50]]), None, [5, 0]),                # summed dims
    (CostModel((100, 50)), np.array([[10, 10], [10, 60], [50, 5]]), None, [5, 0, 2]),  # per dimension
    (CostModel((1000,), quadratic_length=100), col(100, 50), None, [5, 13]),          # weights 200, 75
    (CostModel((10_000,), max_patches=10), col(10, 10, 10, 10), col(3, 0, 11, 10).ravel(), [3, 1000, 0, 1]),
    (CostModel((100,), max_patches=10), col(50, 10), col(2, 4).ravel(), [2, 2]),
    (CostModel((100,), max_patches=10), col(10), None, [10]),                         # no patches given
])
def test_copies_that_fit(model: CostModel, padded, patches, expected) -> None:
    assert model.copies_that_fit(padded, patches).tolist() == expected


def test_copies_that_fit_unrounded_ignores_the_multiple() -> None:
    cm = CostModel((100,), batch_size_multiple=4, max_batch_size=12)
    assert cm.copies_that_fit_unrounded(col(10, 5, 30)).tolist() == [10, 12, 3]
    assert cm.copies_that_fit(col(10, 5, 30), None).tolist() == [8, 12, 3]


def test_round_to_multiple() -> None:
    counts = np.array([0, 1, 3, 8, 13, 16, 23])
    assert CostModel((1,), batch_size_multiple=8).round_to_multiple(counts).tolist() == [0, 1, 3, 8, 8, 16, 16]
    assert CostModel((1,)).round_to_multiple(counts).tolist() == counts.tolist()


@pytest.mark.parametrize("model, padded, patches, expected", [
    # 1-D, sorted decreasing: copies [2, 3, 5, 10, 10] capped by what remains [5, 4, 3, 2, 1].
    (CostModel((100,)), col(50, 30, 20, 10, 10), None, [2, 3, 3, 2, 1]),
    (CostModel((100,), max_batch_size=2), col(20, 10, 10, 10), None, [2, 2, 2, 1]),
    # The multiple is not applied here (greedy_segments applies it).
    (CostModel((100,), batch_size_multiple=4), col(10, 10, 10, 10, 10, 10), None, [6, 5, 4, 3, 2, 1]),
    # Patches [4, 4, 4, 4] under a cap of 10: two per batch, one at the end.
    (CostModel((10_000,), max_patches=10), col(10, 10, 10, 10), col(4, 4, 4, 4).ravel(), [2, 2, 2, 1]),
    (CostModel((10_000,), max_patches=10), col(10, 10, 10), col(9, 2, 0).ravel(), [1, 2, 1]),
    # 2-D, one budget summed over dims: running maxima (40,10)->(40,40) cost 2 x 80 > 100.
    (CostModel((100,)), np.array([[40, 10], [10, 40], [20, 20], [5, 5]]), None, [1, 1, 2, 1]),
    (CostModel((200,)), np.array([[40, 10], [10, 40], [20, 20], [5, 5]]), None, [2, 3, 2, 1]),
    # 2-D, one budget per dim: (40,10)+(10,40) -> (40,40) x 2 = (80, 80) fits (100, 100).
    (CostModel((100, 100)), np.array([[40, 10], [10, 40], [20, 20], [5, 5]]), None, [2, 2, 2, 1]),
    (CostModel((100, 50)), np.array([[40, 10], [10, 40], [20, 20], [5, 5]]), None, [1, 1, 2, 1]),
    (CostModel((100, 100), max_batch_size=1), np.array([[40, 10], [10, 40]]), None, [1, 1]),
    # Weights L x (1 + L/10): (10, 10) -> 20 + 20, so two fit 100 and three do not.
    (CostModel((100,), quadratic_length=10), np.array([[10, 10], [10, 10], [5, 5]]), None, [2, 2, 1]),
])
def test_max_counts_sorted(model: CostModel, padded, patches, expected) -> None:
    assert model.max_counts_sorted(padded, patches).tolist() == expected


def test_check_dims() -> None:
    CostModel((100,)).check_dims(1)
    CostModel((100,)).check_dims(3)  # one budget sums any number of dims
    CostModel((100, 50)).check_dims(2)
    with pytest.raises(ValueError) as info:
        CostModel((100, 50)).check_dims(3)
    msg = str(info.value)
    assert "2 entries" in msg and "3 length dimensions" in msg and "Fix" in msg
    with pytest.raises(ValueError, match="Fix"):
        CostModel((100, 50)).check_dims(1)


def test_from_config_and_total_budget() -> None:
    cfg = ODBConfig(token_budget=(300, 200), pad_to_multiple_of=8, quadratic_length=512, max_batch_size=16,
                    batch_size_multiple=4, image_patches_key="p", max_image_patches=99)
    cm = CostModel.from_config(cfg)
    assert cm.budgets.tolist() == [300.0, 200.0] and cm.total_budget == 500.0
    assert (cm.pad_to, cm.q, cm.max_batch, cm.multiple, cm.max_patches) == (8, 512, 16, 4, 99)
    assert CostModel.from_config(ODBConfig(token_budget=64)).max_batch == INT_MAX


@pytest.mark.parametrize("budget, q, length, copies", [
    (40, 9, 15, 1),  # 15 x (1 + 15/9) = 40 exactly: reported oversize
    (40, 3, 5, 3),   # 3 x 5 x (1 + 5/3) = 40 exactly: only 2 copies
])
def test_copies_that_fit_at_exactly_the_budget_with_quadratic_weight(budget, q, length, copies) -> None:
    assert CostModel((budget,), quadratic_length=q).copies_that_fit(col(length), None).tolist() == [copies]
