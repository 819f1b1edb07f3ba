"""balance criteria are classes (odb.plan.ranks.pairing): a new one is one class and one registered name.

Shown with a criterion of the test's own: pairing by sample count. Ranks rank their groups by the
criterion's price and step k pairs the k-th priciest group of each rank (shuffle=False keeps the
order), so under it each rank's micro-batches of a step come in non-increasing sample counts,
which the planner's cost ("tokens") does not give here.
"""

from __future__ import annotations

from typing import Any, List, Optional

import numpy as np
import pytest

import odb
from helpers import LengthDataset, known_lengths, pad_collate
from odb.plan.ranks.pairing import PAIRINGS, register_pairing
from test_thread_ranks import ok, run_ranks

LENGTHS = known_lengths(96, 2, 60, seed=21)


class SamplesPairing:
    """Pairs by the number of samples in a group (a test-only criterion)."""

    prices = True
    priced = 0

    def freeze(self, step: int) -> None:
        return None

    def ready(self) -> bool:
        return True

    def price(self, padded: np.ndarray, side: Optional[np.ndarray] = None) -> int:
        SamplesPairing.priced += 1
        return len(padded)


@pytest.fixture
def samples_criterion():
    register_pairing("samples", lambda model: SamplesPairing())
    yield
    PAIRINGS.pop("samples")


def local_sizes_per_step(balance: str) -> List[List[List[int]]]:
    def one(rank: int, exchanges: Any) -> List[List[int]]:
        ds = LengthDataset(LENGTHS)
        loader = odb.ODBDataLoader(ds, token_budget=120, global_batch_size=24, balance=balance, shuffle=False,
                                   step_plan="rank",  # ranks pair their own groups (a global plan deals one step's)
                                   sampler=odb.ShardSampler(ds, num_replicas=2, rank=rank, shuffle=True, seed=2),
                                   collate_fn=pad_collate, shift_labels=True, exchange=exchanges)
        steps: List[List[int]] = [[]]
        for batch in loader:
            info = odb.pop_step_info(batch)
            steps[-1].append(info.local_samples)
            if info.is_last_micro_step:
                steps.append([])
        return steps[:-1]

    return ok(run_ranks(2, one))


def ordered(steps: List[List[int]]) -> bool:
    return all(all(a >= b for a, b in zip(s, s[1:])) for s in steps)


def test_a_registered_criterion_pairs_the_ranks_groups(samples_criterion) -> None:
    assert odb.ODBConfig(token_budget=64, balance="samples").balance == "samples"
    by_samples = local_sizes_per_step("samples")
    assert SamplesPairing.priced > 0
    assert all(ordered(rank) for rank in by_samples)
    by_tokens = local_sizes_per_step("tokens")
    assert not all(ordered(rank) for rank in by_tokens)  # the planner's cost orders them otherwise here


def test_an_unknown_criterion_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"balance='samples'.*must be one of \('tokens', 'time'\).*register_pairing"):
        odb.ODBConfig(token_budget=64, balance="samples")
