"""The declared-lengths check's benchmark (odb.bench.declared_check): its "unchecked" arm really runs without the
check, and it reports both arms."""

from __future__ import annotations

import pytest
import torch

from odb.bench.declared_check import check_off, run_declared_check
from odb.data.declared import DeclaredLengthCheck, DeclaredLengthError


def test_check_off_turns_the_comparison_off_and_back_on() -> None:
    stale = {"input_ids": torch.ones(9, dtype=torch.long)}
    with check_off():
        assert DeclaredLengthCheck(None)(0, (3,), stale) is None
    with pytest.raises(DeclaredLengthError, match="sample 0 was declared 3 tokens"):
        DeclaredLengthCheck(None)(0, (3,), stale)


def test_both_arms_are_measured() -> None:
    out = run_declared_check([20 + (i * 37) % 200 for i in range(300)], num_workers=0, budget=1024, repeats=1)
    assert set(out["samples_per_s"]) == {"checked", "unchecked"}
    assert all(v > 0 for v in out["samples_per_s"].values())
    assert 0 < out["check_cpu_us_per_sample"] and 0 < out["check_cpu_share"] < 1
