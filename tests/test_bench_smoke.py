"""Smoke test of the benchmark of `make demo`: `python -m odb.bench --quick` end to end."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

SYNTHETIC = ["lognormal-cv0.29", "lognormal-cv0.48", "lognormal-cv1.00", "encdec-synthetic"]
ODB = ["odb-256", "odb-512", "odb-1024", "odb-2048"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run([sys.executable, "-m", "odb.bench", "--out", str(out), "--quick"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out / "results.json") as f:
        return out, json.load(f), proc.stdout


def test_outputs_written(bench):
    out, results, stdout = bench
    assert set(results) >= {"meta", "planning", "loader", "training", "wall_s"}
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Planner quality" in (out / "summary.md").read_text()
    assert "useful fill" in stdout and "training speedup" in stdout
    assert results["meta"]["quick"] is True


def test_planning_invariants(bench):
    _, results, _ = bench
    planning = results["planning"]
    workloads = planning["workloads"]
    assert set(SYNTHETIC) <= set(workloads)
    rebalance = planning["transformers_samplers"]["BatchRebalanceSampler"]
    for name, w in workloads.items():
        methods = w["methods"]
        assert {"fixed", "length_grouped", "oracle", *ODB} <= set(methods), name
        assert ("batch_rebalance" in methods) == rebalance
        oracle = methods["oracle"]
        assert oracle["ratio_to_oracle"] == pytest.approx(1.0)
        for method, m in methods.items():
            where = f"{name}/{method}"
            if method == "batch_rebalance":  # no token budget; may repeat samples to fill its last step
                assert m["samples_emitted"] >= w["samples"], where
                continue
            assert m["samples_emitted"] == w["samples"], where
            assert m["over_budget_batches"] == 0.0, where
            assert 0.0 < m["useful_fill"] <= m["budget_fill"] + 1e-9 <= 1.0 + 1e-9, where
            assert 0.0 < m["token_efficiency"] <= 1.0, where
            assert m["useful_fill"] == pytest.approx(m["token_efficiency"] * m["budget_fill"]), where
        for method in ODB:
            m = methods[method]
            assert methods["fixed"]["useful_fill"] < m["useful_fill"], (name, method)
            assert 0.3 < m["ratio_to_oracle"] <= 1.02, (name, method)
            assert -1.0 <= m["order_spearman"] <= 1.0
            assert m["mean_abs_displacement"] >= 0.0
            assert m["window_plan_ms_mean"] > 0.0
        if name.startswith("lognormal"):
            assert methods["odb-2048"]["ratio_to_oracle"] >= 0.9, name
            assert all(methods[k]["single_sample_fraction"] < 0.05 for k in ODB), name


def test_loader_and_training_figures(bench):
    _, results, _ = bench
    loader = results["loader"]
    assert set(loader["median"]) == {"plain_bs16", "odb", "plain_bs1"}
    assert loader["median"]["odb"]["samples"] == loader["samples"]
    for key in ("samples_per_s_ratio", "cpu_s_ratio", "loader_throughput_ratio"):
        assert loader["ratios"][key] > 0.0
    training = results["training"]
    fixed, odb = training["fixed"], training["odb"]
    assert fixed["samples"] == odb["samples"] == training["samples"]
    assert fixed["real_tokens"] == odb["real_tokens"]  # same samples, seen once by each arm
    assert odb["mean_batch_size"] >= fixed["mean_batch_size"]
    assert training["speedup"] > 0.0
