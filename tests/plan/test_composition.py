"""Step compositions (odb.plan.steps.composition), pure: every sample of a block in exactly one step, full steps of the
given size with the rest last, the same answer on every call, and length-similar steps in an order whose adjacent
lengths do not follow each other (against sorted megabatches, what group_by_length runs)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from odb.plan.steps.composition import (COMPOSITIONS, LengthGrouped, SamplerOrder, adjacent_correlation, make_composition,
                                  register_composition)


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(0, 500), min_size=1, max_size=120), share=st.integers(1, 9),
       block=st.integers(1, 8), warmup=st.integers(0, 10), first=st.integers(0, 12), epoch=st.integers(0, 2),
       dims=st.integers(1, 2))
def test_every_sample_once_steps_of_the_share(lengths, share, block, warmup, first, epoch, dims):
    arr = np.array(lengths).reshape(-1, 1).repeat(dims, axis=1)
    comp = LengthGrouped(block_steps=block, warmup_steps=warmup)
    steps = comp.compose(arr, share, seed=3, epoch=epoch, block=1, first_step=first)
    flat = np.concatenate(steps)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert all(len(s) == share for s in steps[:-1])
    assert 0 < len(steps[-1]) <= share
    again = comp.compose(arr, share, seed=3, epoch=epoch, block=1, first_step=first)
    assert all((a == b).all() for a, b in zip(steps, again))


def test_steps_are_length_similar_and_unsorted_in_order():
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(6.0, 0.8, size=16 * 32).astype(int)[:, None]
    steps = LengthGrouped(block_steps=32).compose(lengths, 16, seed=1, epoch=0, block=0, first_step=0)
    spread = np.mean([np.ptp(lengths[s]) for s in steps])
    random_spread = np.mean([np.ptp(lengths[k * 16:(k + 1) * 16]) for k in range(32)])
    assert spread < 0.25 * random_spread
    means = [float(lengths[s].mean()) for s in steps]
    assert abs(adjacent_correlation(means)) < 0.4  # shuffled blocks (sorted megabatches: ~1)
    assert adjacent_correlation(sorted(means)) > 0.9


def test_every_rank_draws_the_same_step_order():
    """Ranks compose their own blocks with the same draws: step k of every rank comes from the same quantile."""
    rng = np.random.default_rng(5)
    blocks = [rng.integers(10, 900, size=(64, 1)) for _ in range(3)]  # three ranks' blocks
    composed = [LengthGrouped(block_steps=8).compose(b, 8, seed=7, epoch=2, block=4, first_step=32) for b in blocks]
    ranks = [[np.argsort(np.argsort(b[:, 0]))[s].min() // 8 for s in steps] for b, steps in zip(blocks, composed)]
    assert ranks[0] == ranks[1] == ranks[2]  # the same sorted chunk at every step index


def test_warmup_runs_short_to_long_then_shuffles():
    lengths = np.arange(64)[::-1, None] + 1
    steps = LengthGrouped(block_steps=8, warmup_steps=5).compose(lengths, 8, seed=0, epoch=0, block=0, first_step=0)
    means = [float(lengths[s].mean()) for s in steps]
    assert means[:5] == sorted(means[:5]) and means[:5] == sorted(means)[:5]
    later = LengthGrouped(block_steps=8, warmup_steps=5).compose(lengths, 8, seed=0, epoch=1, block=0, first_step=0)
    assert [float(lengths[s].mean()) for s in later][:5] != sorted(means)[:5]  # epoch 1: no warm-up


def test_sampler_order_keeps_the_order():
    steps = SamplerOrder().compose(np.array([[4], [1], [9]]), 3, seed=0, epoch=0, block=0, first_step=0)
    assert [s.tolist() for s in steps] == [[0, 1, 2]]


def test_registry_refuses_unknown_names_and_takes_new_ones():
    with pytest.raises(ValueError, match="composition='curriculum' names no step composition.*register_composition"):
        make_composition("curriculum")
    register_composition("curriculum", lambda **kw: SamplerOrder())
    try:
        assert isinstance(make_composition("curriculum", block_steps=4), SamplerOrder)
    finally:
        del COMPOSITIONS["curriculum"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_block_steps_are_refused(bad):
    with pytest.raises(ValueError, match="composition_block_steps=.*Fix"):
        LengthGrouped(block_steps=bad)
