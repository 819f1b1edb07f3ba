"""The planning benchmark: its independent oracle on hand-made cases, its figures, and the planner's
quality at its defaults on every benchmark workload (planning only, nothing timed)."""

import numpy as np
import pytest
import transformers  # noqa: F401  (LengthGroupedSampler; pinned: a broken install fails, never skips)

import odb
from odb.bench.planning import (DEFAULT, SHORT_EPOCHS, LengthGroupedSampler, _baselines, _compare, batch_metrics,
                                load_workloads, odb_loader_run, oracle_batches, short_epochs)
from odb.bench.report import order_rho_max
from odb.bench.workloads import encoder_decoder_lengths, lognormal_lengths

BUDGET = 16384
HEAVY_TAILED = ("pareto",)
SHORT_EPOCH_RHO_MAX = 0.35  # |rank correlation| of the batch order with length on short epochs (see below)
# The benchmark's seven planning workloads (python -m odb.bench), the two real ones read from odb/bench/data.
WORKLOADS = ["lognormal-cv0.29", "lognormal-cv0.48", "lognormal-cv1.00", "pareto-a1.2", "sharegpt-gpt2",
             "encdec-synthetic", "gettext-en-de"]


def as_lists(batches):
    return [b.tolist() for b in batches]


# ---- the oracle ------------------------------------------------------------------------------
@pytest.mark.parametrize("lengths, budget, multiple, expected", [
    # sorted 55, 50, 45, 30, 20: 2 x 55 > 100, so 55 is alone; 3 x 50 > 100 closes [50, 45]
    ([50, 30, 20, 45, 55], 100, 1, [[4], [0, 3], [1, 2]]),
    # padded to 8: 16, 16, 24, 8; ties keep index order; 3 x 24 > 48
    ([10, 9, 17, 3], 48, 8, [[2, 0], [1, 3]]),
    # equal lengths: exactly budget // length per batch, the rest in a last batch
    ([10] * 7, 30, 1, [[0, 1, 2], [3, 4, 5], [6]]),
    # one sample over the budget gets a batch of its own
    ([150, 40, 40], 100, 1, [[0], [1, 2]]),
])
def test_oracle_cuts_sorted_lengths_greedily(lengths, budget, multiple, expected):
    assert as_lists(oracle_batches(np.array(lengths), budget, multiple)) == expected


def test_oracle_prices_two_lengths_by_the_sum_of_their_maxima():
    # Sums 12, 12, 12, 10: pairs (10, 2) and (2, 10) cost 2 x (10 + 10) = 40, a third makes 60 > 40.
    pairs = np.array([[10, 2], [2, 10], [6, 6], [5, 5]])
    assert as_lists(oracle_batches(pairs, 40)) == [[0, 1], [2, 3]]
    # At 39 the first pair no longer fits: (10, 2) alone, then (2, 10) + (6, 6) = 2 x (6 + 10) = 32,
    # and (5, 5) would make 3 x 16 = 48.
    assert as_lists(oracle_batches(pairs, 39)) == [[0], [1, 2], [3]]


@pytest.mark.parametrize("lengths", [lognormal_lengths(900.0, 1.0, 3000, seed=3), encoder_decoder_lengths(3000, 4)],
                         ids=["lognormal", "encdec"])
@pytest.mark.parametrize("multiple", [1, 8])
def test_oracle_emits_every_sample_once_within_the_budget(lengths, multiple):
    x = np.asarray(lengths).reshape(len(lengths), -1)
    batches = oracle_batches(x, BUDGET, multiple)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(x)))
    padded = -(-x // multiple) * multiple
    costs = [len(b) * padded[b].max(axis=0).sum() for b in batches]
    assert max(costs) <= BUDGET
    # greedy: adding the next batch's first sample to a batch would break the budget
    for b, nxt in zip(batches, batches[1:]):
        grown = np.concatenate((b, nxt[:1]))
        assert (len(b) + 1) * padded[grown].max(axis=0).sum() > BUDGET


def test_batch_metrics_on_a_hand_made_plan():
    lengths = np.array([[10], [5], [8], [8]])
    m = batch_metrics(lengths, [np.array([0, 1]), np.array([2, 3])], budget=20)
    # real 31; padded 2 x 10 + 2 x 8 = 36; 2 steps
    assert m["steps"] == 2
    assert m["token_efficiency"] == pytest.approx(31 / 36)
    assert m["tokens_per_step"] == pytest.approx(15.5)
    assert m["useful_fill"] == pytest.approx(31 / 40)
    assert m["budget_fill"] == pytest.approx(36 / 40)


# ---- odb at its defaults against LengthGroupedSampler and the oracle ----------------------------
@pytest.fixture(scope="module")
def workloads():
    """20,000 samples of each workload, as `make demo` plans them (about 0.5 s per workload here)."""
    def refuse(message: str) -> None:
        raise AssertionError(f"the benchmark's real workloads do not load ({message}): they ship with odb "
                             f"(src/odb/bench/data/*.npz). Fix: reinstall odb (pip install -e .)")

    out = load_workloads(20000, log=refuse)
    assert sorted(out) == sorted(WORKLOADS)
    assert LengthGroupedSampler is not None, "transformers has no LengthGroupedSampler: the baseline is missing"
    return out


def _floor(odb_eff: float, grouped: float, oracle: float, name: str) -> float:
    """odb's token efficiency must reach LengthGroupedSampler's, less rounding. Where the oracle itself (every
    length known, budget-filling batches) is not clearly above LengthGrouped (by 0.005), a budget-filling plan
    online cannot be expected to reach it: odb must then stay within 0.04 of the oracle (0.06 for heavy
    tails; measured gaps up to 0.031 and 0.055, on 600 and 2,000 samples)."""
    if oracle >= grouped + 0.005:
        return grouped - 0.002
    return oracle - (0.06 if name.startswith(HEAVY_TAILED) else 0.04)


@pytest.mark.parametrize("name", WORKLOADS)
def test_odb_defaults_plan_as_well_as_length_grouping_and_near_the_oracle(workloads, name):
    """The benchmark's planning goals at odb's defaults (docs/benchmarks.md, "Goals"), asserted: a regression
    of the planner's defaults fails `make test`, not only the benchmark's table."""
    x = workloads[name]
    methods = _baselines(x, BUDGET, seed=0)
    run = odb_loader_run(x, odb.ODBConfig(token_budget=BUDGET), seed=0)
    methods[DEFAULT] = batch_metrics(x, run["batches"], BUDGET)
    _compare(methods)
    d, grouped, oracle = methods[DEFAULT], methods["length_grouped"], methods["oracle"]
    assert d["samples_emitted"] == len(x) and d["over_budget_batches"] == 0.0
    # Full epochs: at least LengthGroupedSampler's token efficiency, the benchmark's goal (measured at seed 0:
    # 0.984-0.993 against 0.968-0.986 on the lognormal and ShareGPT workloads, 0.959 against 0.836 on Pareto,
    # 0.898 / 0.812 against 0.846 / 0.789 on the two-length ones; the closest, ShareGPT, 0.984 against 0.982)
    assert d["token_efficiency"] >= grouped["token_efficiency"], (d["token_efficiency"], grouped["token_efficiency"])
    # Useful fill against the oracle's, the benchmark's goal of 0.97 (0.95 for heavy tails); measured 0.984-0.994
    # with one length, 1.078 / 1.091 with two
    assert d["ratio_to_oracle"] >= (0.95 if name.startswith(HEAVY_TAILED) else 0.97)
    if x.shape[1] == 2:  # the banded order of two lengths (odb.plan.windows.planner.sort_order) beats the sort by the total
        assert d["ratio_to_oracle"] >= 1.03
    # The emitted order follows length no more than a random order of as many batches would at 3 sigma, and no
    # more than 0.1 on long epochs: |rho| <= max(0.1, 3 / sqrt(steps - 1)) (docs/algorithm.md, "Order"; measured
    # at seed 0: -0.03 to -0.00 over 882-1,985 steps, +0.06 over Pareto's 95, +0.17 over the encoder-decoder
    # pairs' 116, +0.25 over gettext's 55)
    assert abs(d["order_spearman"]) <= order_rho_max(d["steps"])

    for n, e in short_epochs(x, BUDGET).items():
        ms = e["methods"]
        eff = ms[DEFAULT]["token_efficiency"]
        assert eff >= _floor(eff, ms["length_grouped"]["token_efficiency"], ms["oracle"]["token_efficiency"],
                             name), (n, ms[DEFAULT], ms["length_grouped"], ms["oracle"])
        assert e["samples"] in SHORT_EPOCHS
        # Short epochs drift beyond noise: their ramp-up windows emit long batches first (docs/algorithm.md,
        # "Order"). Mean of 3 seeds, measured -0.27 to +0.10 where an epoch has 20 or more batches (ShareGPT
        # -0.27 / -0.24 at 600 / 2,000 samples, lognormal CV 1.00 -0.26 / -0.18); fewer batches are noise.
        if ms[DEFAULT]["steps"] >= 20:
            assert abs(ms[DEFAULT]["order_spearman"]) <= SHORT_EPOCH_RHO_MAX, (n, ms[DEFAULT]["order_spearman"])
