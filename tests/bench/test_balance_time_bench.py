"""benchmarks/balance_time.py (issue 17's balance="time" goal on 8 simulated ranks): its --quick run
end to end, and the synthetic step functions it measures with."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "balance_time.py"


def load():
    spec = importlib.util.spec_from_file_location("balance_time", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_step_functions_have_the_stated_shape():
    bt = load()
    # padded: only B and the longest length matter; the quadratic term dominates the longest samples
    assert bt.step_seconds([2048, 10]) == bt.step_seconds([2048, 2048])
    linear = bt.T_TOKEN * 2048
    quadratic = bt.T_TOKEN * 2048 * 2048 / bt.TIME_QUAD_LEN
    assert quadratic > 2 * linear
    assert bt.step_bytes([100] * 4) > bt.step_bytes([100] * 3) > bt.step_bytes([100] * 2)
    cap = bt.memory_cap(2048)
    assert bt.step_bytes([2048] * 3) < 0.9 * cap < bt.step_bytes([2048] * 4)  # the budget matters
    assert bt.imbalance(np.array([[1.0, 3.0], [1.0, 1.0]])).tolist() == [1.0, 1.5]


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    out = tmp_path_factory.mktemp("balance_time") / "bt.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True,
                         text=True, cwd=ROOT, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


@pytest.mark.timeout(300)
def test_quick_run_writes_every_figure_and_the_table(quick):
    doc, stdout = quick
    assert set(doc) >= {"config", "goal", "results", "wall_s"}
    assert doc["config"]["world"] == 8 and doc["config"]["seeds"] == [0, 1, 2]
    assert set(doc["results"]) == {"lognormal-cv0.29", "lognormal-cv0.48", "lognormal-cv1.00", "pareto-a1.2"}
    assert doc["goal"]["workloads"] == ["lognormal-cv0.29", "lognormal-cv0.48", "lognormal-cv1.00"]
    assert isinstance(doc["goal"]["met"], bool) and doc["goal"]["mean_imbalance_after_warmup_at_most"] == 1.05
    for name, arms in doc["results"].items():
        assert set(arms) == {"tokens", "time"}
        for balance, arm in arms.items():
            assert set(arm["runs"]) == {"0", "1", "2"}
            for seed, s in arm["runs"].items():
                # the aligner's promise: every rank runs the same steps (run_ranks refuses otherwise)
                assert s["steps_each_rank"] == [s["steps_per_rank"]] * 8 and s["steps_per_rank"] > 0
                for kind in ("true_imbalance", "measured_imbalance"):
                    for key in ("mean", "p95"):
                        assert 1.0 <= s[kind][key] < math.inf
                # same data and seeds: the arms run the same number of steps, the same warm-up
                other = arms["tokens" if balance == "time" else "time"]["runs"][seed]
                assert s["warmup_steps"] == other["warmup_steps"]
                for key in ("mean", "p95", "mean_after_warmup"):  # no noise at --quick's default
                    assert s["true_imbalance"][key] == s["measured_imbalance"][key]
            m = arm["median"]["imbalance_mean"]
            assert m["min"] <= m["median"] <= m["max"]
        assert f"| {name} | time |" in stdout and f"| {name} | tokens |" in stdout
    assert "goal: balance='time'" in stdout


@pytest.mark.timeout(300)
def test_time_balancing_is_not_worse_than_tokens_on_the_quadratic_workload(quick):
    doc, _ = quick
    arms = doc["results"]["lognormal-cv1.00"]
    for seed in ("0", "1", "2"):
        time_, tokens = arms["time"]["runs"][seed], arms["tokens"]["runs"][seed]
        assert time_["warmup_steps"] < time_["steps_per_rank"]  # the time model was fitted and used
        after = time_["true_imbalance"]["mean_after_warmup"]
        assert after <= tokens["true_imbalance"]["mean_after_warmup"] + 1e-9
        assert time_["true_imbalance"]["mean"] <= tokens["true_imbalance"]["mean"] + 1e-9
        # pairing cannot beat the floor of sorting every rank's steps by time
        assert time_["true_imbalance"]["sorted_pairing_floor_after_warmup"] <= after + 1e-9
