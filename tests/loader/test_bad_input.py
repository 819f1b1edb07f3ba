"""Bad input under every plan: each case of tests/support/bad_input_cases.py through the real loader in every mode.

Modes: padded and packed rows; lengths known (``lengths=``), measured online (map-style) or streamed (an
IterableDataset); budget-filled steps, ``global_batch_size`` with ``step_plan="rank"`` and with
``step_plan="global"``; 1, 2 and 3 ranks (ranks as threads exchanging through odb.comm.threads; the global plan
also on 2 gloo processes below). Cases: empty samples (one, a whole rank's share of a step, a whole step), all
labels masked (one sample, a whole step), stale declared lengths (over and under), a sample that grows between
epochs, a sample longer than the budget, a ``None`` sample, a sample without ``input_ids``, a ``__getitem__`` that
raises once.

Each case either trains, every epoch holding every sample exactly once with no batch over the budget, or every
rank raises within seconds, naming the sample and the fix. An internal exception type (OverflowError,
IndexError, ZeroDivisionError, AssertionError, KeyError) fails the test.
"""

from __future__ import annotations

import collections
import itertools
import math
import warnings
from typing import Any, Dict, List

import pytest

from bad_input_cases import BUDGET, CASES, EPOCHS, GLOBAL_BATCH, N, STALE, Spec, run_case
from dist_harness import run_ranks as gloo_ranks
from test_thread_ranks import run_ranks

INTERNAL = {"OverflowError", "IndexError", "ZeroDivisionError", "AssertionError", "KeyError", "AttributeError",
            "UnboundLocalError", "FloatingPointError"}
RAISE_WITHIN_S = 10.0
MODES = [(layout, source, plan, world)
         for layout, source, plan, world in itertools.product(("padded", "packed"), ("known", "online", "streamed"),
                                                              ("filled", "rank", "global"), (1, 2, 3))
         if not (world == 1 and plan == "rank")]  # one rank: "rank" and "global" are one plan


def runs(case: str, layout: str, source: str, plan: str, world: int) -> List[Dict[str, Any]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if world == 1:
            return [run_case(0, 1, None, case, layout, source, plan)]
        return run_ranks(world, lambda rank, ex: run_case(rank, world, ex, case, layout, source, plan), timeout_s=30)


def check(out: List[Dict[str, Any]], case: str, source: str, plan: str, world: int) -> None:
    spec = Spec(case, world, source)
    errors = [o["error"] for o in out if "error" in o]
    for name, message, trace in errors:
        assert name not in INTERNAL, f"an internal error reached the user:\n{trace}"
    if spec.expect == "raise":
        assert len(errors) == world, f"{len(errors)} of {world} ranks raised: {[e[1][:200] for e in errors]}"
        for (name, message, trace), o in zip(errors, out):
            assert spec.names in message, f"the error does not name {spec.names!r}: {message}"
            assert "Fix" in message or name == "OSError", message  # the user's own error is theirs to word
            assert o["seconds"] < RAISE_WITHIN_S, f"a rank raised after {o['seconds']:.1f} s"
        return
    assert not errors, f"case {case} must train; ranks raised:\n" + "\n".join(e[2] for e in errors)
    for epoch in range(EPOCHS):
        batches = [o["batches"][epoch] for o in out]
        assert len({len(b) for b in batches}) == 1, f"epoch {epoch}: ranks emitted {[len(b) for b in batches]}"
        ids = collections.Counter(i for rank in batches for b in rank for i in b["ids"])
        assert ids == collections.Counter(range(N)), f"epoch {epoch}: samples not each once: {ids}"
        for rank in batches:
            for b in rank:
                assert 1 <= b["tokens"] <= BUDGET, f"a batch of {b['tokens']} tokens (budget {BUDGET})"
                assert math.isfinite(b["scale"]) and b["scale"] >= 0
        if plan != "filled":  # the user's steps: GLOBAL_BATCH samples each, all ranks together
            steps, held = [], 0
            for b in batches[0]:  # all_samples_this_step: the micro-step's samples on every rank
                held += b["samples"]
                if b["last"]:
                    steps.append(held)
                    held = 0
            assert sum(steps) == N and all(s == GLOBAL_BATCH for s in steps[:-1]), steps


@pytest.mark.parametrize("case", CASES)
def test_bad_input_matrix(case: str) -> None:
    """Every mode of one case (48 runs, ranks as threads)."""
    for layout, source, plan, world in MODES:
        out = runs(case, layout, source, plan, world)
        try:
            check(out, case, source, plan, world)
        except AssertionError as err:
            raise AssertionError(f"case {case}, {layout} {source} {plan}, {world} ranks: {err}") from None


@pytest.mark.parametrize("source", ["known", "online"])
def test_shorter_than_declared_is_counted_and_reported_once(source: str) -> None:
    """A sample that loads shorter than ``lengths=`` declares trains, is counted in ``odb_stats`` and warned about
    once. With a length column read by a length_fn odb cannot tell a shorter input from a length_fn that prices
    more than the input_ids (images), so only ``lengths=`` is reported."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out = run_case(0, 1, None, "stale_under", "padded", source, "global")
    assert "error" not in out, out.get("error")
    shorter = [w for w in seen if "shorter than declared" in str(w.message)]
    if source == "known":
        assert out["stats"]["shorter_than_declared"] == EPOCHS  # sample STALE, once an epoch
        assert len(shorter) == 1 and f"sample {STALE}" in str(shorter[0].message)
    else:
        assert out["stats"]["shorter_than_declared"] == 0 and not shorter


@pytest.mark.dist
@pytest.mark.parametrize("case,layout,source", [("empty_step", "padded", "online"), ("empty_share", "packed", "known"),
                                                ("masked_step", "padded", "known"),
                                                ("stale_over", "padded", "known"), ("stale_over", "packed", "online"),
                                                ("stale_under", "packed", "known"), ("raises_once", "padded", "online")])
def test_global_plan_on_gloo(case: str, layout: str, source: str, tmp_path: Any) -> None:
    """The global step plan on 2 real processes (samples move between ranks through gloo)."""
    out = gloo_ranks("bad_input_cases:gloo_case", 2, {"case": case, "layout": layout, "source": source,
                                                    "plan": "global"}, tmp_path, deadline_s=60)
    check(out, case, source, "global", 2)
