"""odb.bench.auto_budget (make demo's auto-budget section, benchmarks/auto_budget.py alone): its oracle
search, the users' rule, and tiny end-to-end runs (correctness only, nothing timed)."""

import numpy as np
import pytest

import odb.bench.auto_budget as bench


def synthetic_memory(a=1.0, b=0.01, c=5.0, d=100.0):
    """A memory function of a padded group: B x (a L + b L^2 + c) + d (monotonic in B and L)."""
    def mem(lengths):
        lengths = np.asarray(lengths)
        top = float(lengths.max())
        return len(lengths) * (a * top + b * top * top + c) + d
    return mem


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_budget_is_the_largest_that_keeps_every_step_under_the_cap(seed):
    lengths = np.random.default_rng(seed).integers(8, 200, size=300)
    mem = synthetic_memory()
    cap = 3000.0
    budget, tried = bench.oracle_budget(lengths, mem, cap)
    assert tried > 2
    fits = [mem(lengths[g]) <= cap for g in bench.oracle_batches(lengths, budget)]
    assert all(fits)
    over = [mem(lengths[g]) for g in bench.oracle_batches(lengths, budget + 1)]
    assert max(over) > cap          # one more token of budget makes some step exceed the cap


def test_oracle_budget_step_and_independent_planner():
    lengths = np.array([100, 100, 50, 50, 50, 50, 10])
    mem = synthetic_memory(a=1.0, b=0.0, c=0.0, d=0.0)   # memory = padded tokens: the cap is the budget
    budget, _ = bench.oracle_budget(lengths, mem, 250.0)
    # 299 still plans [100, 100] and [50 x 4, 10] (250 each); 300 lets a 50 join the 100s (300 > 250).
    assert budget == 299
    # The planner is oracle_batches (every length known, sorted, cut greedily), not odb's.
    assert [sorted(g.tolist()) for g in bench.oracle_batches(lengths, budget)] == [[0, 1], [2, 3, 4, 5, 6]]


def test_oracle_budget_refuses_a_cap_below_one_longest_sample():
    with pytest.raises(ValueError, match="longest sample"):
        bench.oracle_budget(np.array([100, 20]), synthetic_memory(), 50.0)


def test_users_rule_on_a_hand_made_case():
    # B copies of the longest sample (100 tokens) cost 1000 B + 300: B = 3 fits 3300 <= 3500, B = 4 does not.
    budget = bench.users_rule_budget(lambda b: 1000.0 * b + 300.0, 100, 3500.0)
    assert budget == 300
    # Not even two fit: one sample of the longest length per batch.
    assert bench.users_rule_budget(lambda b: 1000.0 * b, 100, 1500.0) == 100


def test_summary_counts_steps_over_the_cap_in_and_after_the_warmup():
    log = bench.EpochLog(real=[10] * 60, padded=[12] * 60, memory=[5.0] * 60, budgets=[20.0] * 60, seconds=1.0)
    log.memory[3] = 11.0
    log.memory[55] = 12.0
    s = bench.summarize(log, 10.0)
    assert (s["over_cap_warmup"], s["over_cap_after"], s["steps"]) == (1, 1, 60)
    assert s["max_mem_over_cap"] == pytest.approx(1.2)
    assert s["token_eff"] == pytest.approx(10 / 12)


def test_main_runs_end_to_end_on_a_tiny_workload(tmp_path):
    out = tmp_path / "auto.json"
    result = bench.main(["--quick", "--samples", "40", "--max-len", "48", "--workloads", "lognormal-cv1.0",
                         "--threads", "1", "--auto-mode", "manual", "--out", str(out)])
    assert out.exists()
    assert [(c["workload"], c["attention"]) for c in result["cases"]] == [("lognormal-cv1.0", "eager"),
                                                                          ("lognormal-cv1.0", "sdpa")]
    for case in result["cases"]:
        assert set(case["runs"]) == set(bench.ARMS)
        for arm, runs in case["runs"].items():
            assert len(runs) == 1 and runs[0]["steps"] > 0
        # The oracle's own epoch never exceeds the cap (its budget was searched on these shapes).
        oracle = case["runs"]["oracle"][0]
        assert oracle["over_cap_warmup"] == 0 and oracle["over_cap_after"] == 0
        assert case["oracle_budget"] >= case["max_len"]
        assert case["auto_mode"] == "manual"
        # The plain budget under auto's usable memory ((1 - margin) x cap) is no larger than the oracle's, and
        # none of its batches exceeds that memory.
        assert case["max_len"] <= case["oracle_at_margin_budget"] <= case["oracle_budget"]
        assert case["oracle_at_margin_steps"] >= case["runs"]["oracle"][0]["steps"]
    assert len(result["goals"]) == 2
    rows = bench.goal_rows(result)
    # per case: after warm-up vs the oracle, steps over the cap; eager adds memory-planned vs plain
    assert len(rows) == 5 and all(len(r) == 4 for r in rows)
    assert rows[1][1] == str(result["goals"][0]["auto_over_cap_after_warmup"])


@pytest.mark.timeout(300)
def test_the_loader_arm_runs_token_budget_auto_and_records_its_model(tmp_path):
    result = bench.run_auto_budget(quick=True, samples=60, repeats=1, max_len=48,
                                   workload_names=["pareto-a1.2"], attentions=["eager"], auto_mode="loader",
                                   progress=lambda m: None)
    case = result["cases"][0]
    assert case["auto_mode"] == "loader"
    auto = case["runs"]["auto"][0]
    assert auto["steps"] > 0 and auto["over_cap_after"] == 0
    # the loader's fitted model and its plan, from odb_stats
    stats = case["auto_metrics"][0]
    assert stats["auto_observed_steps"] == auto["steps"]
    assert stats["auto_cap"] == case["cap_bytes"]
