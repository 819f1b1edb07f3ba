"""Smoke test of the benchmark of `make demo`: `python -m odb.bench --quick` end to end, and its pieces."""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import matplotlib  # noqa: F401  (the benchmark's plots; pinned under `make test`: a broken install fails here)
import transformers  # noqa: F401  (its samplers and models)

import odb
from odb.bench import convergence
from odb.bench.planning import batch_metrics, odb_configs, odb_loader_run, time_planner
from odb.bench.report import goals
from odb.bench.verdict import verdict
from odb.bench.workloads import encoder_decoder_lengths, lognormal_lengths, pareto_lengths
from quick_bench import ROOT, TEST_TIMEOUT_S

SYNTHETIC = ["lognormal-cv0.29", "lognormal-cv0.48", "lognormal-cv1.00", "pareto-a1.2", "encdec-synthetic"]
ODB = ["odb-512", "odb-2048", "odb-default"]


def missing_citations(text: str, *folders: str) -> list:
    """The .md files that ``text`` names but neither the repository (its root, docs/) nor ``folders`` hold."""
    names = set(re.findall(r"[\w./-]+\.md\b", text))
    return sorted(n for n in names if not any(os.path.exists(os.path.normpath(os.path.join(b, n)))
                                              for b in (*folders, ROOT, os.path.join(ROOT, "docs"))))


# The quick run (tests/support/quick_bench.py, once per session); the tests that use it get its time limit.
BENCH_TIMEOUT = pytest.mark.timeout(TEST_TIMEOUT_S)


@pytest.fixture(scope="module")
def bench(quick_bench):
    return quick_bench.out, quick_bench.results, quick_bench.stdout


@BENCH_TIMEOUT
def test_outputs_written(bench, quick_bench):
    out, results, stdout = bench
    assert set(results) >= {"meta", "convergence", "planning", "ranks", "loader", "training", "e2e", "packing",
                            "auto_budget", "wall_s"}
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = (out / "summary.md").read_text()
    for heading in ("Goals", "Convergence at the user's settings", "Planner quality", "odb buffers", "Loader cost", "Training", "End to end",
                    'token_budget="auto" under a memory cap'):
        assert heading in summary and heading in stdout, heading
    assert "useful fill" in stdout and "odb padded x" in stdout and "overlap" in stdout
    assert (out / "training_loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the closing screen names every file written, every plot among them (training_loss.png was missing once)
    closing = stdout[stdout.rindex("plots:"):]
    for name in ("results.json", "loss_vs_time.png", "bench.png", "training_loss.png", "step_metrics.png",
                 "summary.md"):
        assert str(out / name) in closing and (out / name).exists(), name
    # the first table: convergence at the user's settings, every arm, A = 1 and 8
    assert summary.index("Convergence at the user's settings") < summary.index("Planner quality")
    conv = results["convergence"]
    assert set(conv["accumulations"]) == {"1", "8"}
    for part in conv["accumulations"].values():
        assert set(part["arms"]) == set(convergence.ARMS)
        for m in part["arms"].values():
            assert m["steps"] >= 1 and m["samples_per_step"] > 0 and m["loss_by_step"]
    assert [g["goal"].split(": ")[-1] for g in conv["goals"]][:3] == [
        "time to target, odb padded / fixed", "time to target, odb padded / group_by_length",
        "time to target, odb packed / group_by_length"]
    # the default (global) step plan against the per-rank plan, at A = 8 and A = 1
    plans = [g["goal"] for g in conv["goals"] if "per-rank plan" in g["goal"]]
    assert [p.split(": ")[0] for p in plans] == ["convergence (2 ranks, A = 8)", "convergence (2 ranks, A = 1)"]
    assert "[bench] convergence" in quick_bench.stderr and "[bench] end to end" in quick_bench.stderr
    # The printed goals table holds every goal of the results, in order, with its figure, target and verdict.
    expected = goals(results)
    for part in ("end to end, ", "window ", "short epoch ", "order ", "planning ", "loader (", "packed ", "training (",
                 "auto budget "):
        assert any(name.startswith(part) for name, *_ in expected), f"no goal starts with {part!r}"
    lines = stdout.splitlines()
    start = lines.index("== Goals") + 2  # past the table's header line
    rows = lines[start:start + len(expected) + 1]
    assert len(rows) == len(expected) + 1 and not rows[-1].strip(), "the goals table has another number of rows"
    for row, (name, measured, target, ok, straddles) in zip(rows, expected):
        assert row.strip().startswith(name) and measured in row and target in row, (row, name)
        assert row.rstrip().endswith("  " + verdict(ok, straddles)), (row, ok)
    assert results["meta"]["quick"] is True
    assert not missing_citations(summary, str(out)), "the summary cites files that do not exist"


@BENCH_TIMEOUT
def test_the_bench_changes_no_file_of_the_checkout_and_draws_no_bars_into_a_log(quick_bench):
    """`make demo` leaves `git status` clean: the benchmark writes under --out only (README.md and
    docs/benchmarks.md change by `make publish`), and with stderr piped (a log) it draws no progress bars."""
    if quick_bench.copy is None:
        pytest.skip("not a git checkout: no fresh copy to run the benchmark in")
    assert quick_bench.status == "", (f"python -m odb.bench --out <tmp>, run in a fresh copy of the checkout, left "
                                      f"this git status there:\n{quick_bench.status}Rule: it writes under --out only.")
    assert "\r" not in quick_bench.stderr, "a progress bar was redrawn into a piped stderr: bars belong on a terminal"


@BENCH_TIMEOUT
def test_planning_invariants(bench):
    _, results, _ = bench
    planning = results["planning"]
    workloads = planning["workloads"]
    assert set(SYNTHETIC) <= set(workloads)
    rebalance = planning["transformers_samplers"]["BatchRebalanceSampler"]
    assert planning["odb_default_window"]["buffer_size"] == odb.ODBConfig(token_budget=16384).buffer_size
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
            where = f"{name}/{method}"
            assert m["source"] == "ODBDataLoader", where
            assert m["plan_stream_same_batches"], where
            assert methods["fixed"]["useful_fill"] < m["useful_fill"], where
            # one length: the greedy sorted cut makes the fewest steps; with two, odb's banded order
            # (odb.plan.windows.planner.sort_order) can make fewer than the oracle's sort by the total
            assert 0.2 < m["ratio_to_oracle"] <= (1.02 if w["dims"] == 1 else 1.15), where
            # odb shuffles the batches of a window: a sample leaves away from its arrival position
            assert m["mean_abs_displacement"] > 0.0, where
            assert m["window_plan_ms_mean"] > 0.0 and m["plan_us_per_sample"] > 0.0
            assert 0 < m["peak_held_samples"] <= w["samples"] and m["peak_held_tokens"] > 0
        if name.startswith("lognormal"):
            assert methods["odb-2048"]["ratio_to_oracle"] >= 0.9, name
            assert all(methods[k]["single_sample_fraction"] < 0.05 for k in ODB), name


@pytest.mark.parametrize("lengths", [lognormal_lengths(900.0, 1.0, 3000), pareto_lengths(1.2, 3000),
                                     encoder_decoder_lengths(3000)], ids=["lognormal", "pareto", "encdec"])
@pytest.mark.parametrize("config", ["odb-512", "odb-default"])
def test_planning_path_emits_the_loaders_batches(lengths, config):
    """odb.plan.windows.window.plan_stream (the benchmark's planner timing) plans exactly the batches ODBDataLoader emits."""
    cfg = odb_configs(16384, (512,))[config]
    lengths = np.asarray(lengths).reshape(len(lengths), -1)
    run = odb_loader_run(lengths, cfg, seed=0, sequential=True)
    assert run["read_order"].tolist() == list(range(len(lengths)))
    groups, _ = time_planner(lengths, cfg)
    assert sorted(map(sorted, (b.tolist() for b in run["batches"]))) == sorted(map(sorted, (g.tolist() for g in groups)))
    shuffled = odb_loader_run(lengths, cfg, seed=0)  # the run the tables report: the loader's own shuffle
    assert sorted(np.concatenate(shuffled["batches"]).tolist()) == list(range(len(lengths)))
    again = odb_loader_run(lengths, cfg, seed=0)
    assert [b.tolist() for b in again["batches"]] == [b.tolist() for b in shuffled["batches"]]


def average_ranks(values):
    """1-based ranks, ties sharing the mean of their positions (written apart from odb.bench.planning)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    ranks = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            ranks[order[k]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def test_order_and_displacement_figures_follow_their_definitions():
    """The table's "order rho" (Spearman correlation of a batch's position with its mean length) and "mean abs
    disp." (how far a sample leaves from its arrival position), recomputed by hand from one loader run."""
    lengths = lognormal_lengths(900.0, 1.0, 3000).reshape(-1, 1)
    cfg = odb_configs(16384, (512,))["odb-512"]
    run = odb_loader_run(lengths, cfg, seed=0)
    m = batch_metrics(lengths, run["batches"], 16384, run["arrival"])
    means = [float(lengths[b, 0].mean()) for b in run["batches"]]
    rx, ry = average_ranks(list(range(len(means)))), average_ranks(means)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    rho = cov / (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    assert m["order_spearman"] == pytest.approx(rho, abs=1e-12)
    emitted = [int(i) for b in run["batches"] for i in b]
    disp = sum(abs(pos - int(run["arrival"][i])) for pos, i in enumerate(emitted)) / len(emitted)
    assert m["mean_abs_displacement"] == pytest.approx(disp, rel=1e-12)
    assert disp > 0.0 and abs(rho) < 0.5  # shuffled batches; a window-sized drift, not a sort by length
    # a batch order sorted by length gives rho = -1 (longest first), and arrival order no displacement
    by_length = sorted(run["batches"], key=lambda b: -float(lengths[b, 0].mean()))
    assert batch_metrics(lengths, by_length, 16384)["order_spearman"] == pytest.approx(-1.0)
    in_order = [np.arange(a, min(a + 7, len(lengths))) for a in range(0, len(lengths), 7)]
    assert batch_metrics(lengths, in_order, 16384, np.arange(len(lengths)))["mean_abs_displacement"] == 0.0


@BENCH_TIMEOUT
def test_loader_training_and_e2e_figures(bench):
    _, results, _ = bench
    loader = results["loader"]
    assert set(loader["regimes"]) == {"defaults", "buffer_size=256"}
    for reg in loader["regimes"].values():
        assert set(reg["median"]) == {"odb", "plain_replay"}
        assert reg["median"]["odb"]["samples"] == reg["median"]["plain_replay"]["samples"] == reg["samples"]
        for arm in reg["median"].values():
            assert arm["thread_cpu_us_per_sample"] > 0.0
        for key in ("samples_per_s_ratio", "cpu_s_ratio", "thread_cpu_ratio"):
            assert reg["ratios"][key] > 0.0
    training = results["training"]
    assert set(training["arms"]) == {"fixed", "group_by_length", "batch_rebalance", "trl_packing", "odb_padded",
                                     "odb_packed"}
    assert set(training["ranks2"]["workloads"]) == {"short-pairs", "heavy-tailed", "long-chat"}
    assert set(training["ranks1"]["workloads"]) == {"heavy-tailed"}
    for part, world in (("ranks2", 2), ("ranks1", 1)):
        assert training[part]["world"] == world
        for w in training[part]["workloads"].values():
            assert set(w["arms"]) == set(training["arms"])
            odb_tokens = w["arms"]["odb_padded"]["real_tokens"]
            assert odb_tokens == w["arms"]["odb_packed"]["real_tokens"] == w["tokens"]  # each sample once
            assert all(v > 0.0 for v in w["odb_over"]["odb_padded"].values())
    assert training["goals"] and all(isinstance(g["met"], bool) for g in training["goals"])
    e2e = results["e2e"]
    assert set(e2e["settings"]) == {"compute-bound", "data-bound", "compute-bound, GIL-holding step",
                                    "data-bound, GIL-holding step"}
    assert e2e["data_s"] > 0.0 and e2e["plain_fit_batch_size"] >= 1
    for st in e2e["settings"].values():
        assert set(st["median"]) == {"odb", "plain-fit", "length-grouped", "plain-mean"}
        for m in st["median"].values():
            assert m["samples"] == e2e["samples"]
            assert m["epoch_s"] > 0.0 and m["compute_s"] > 0.0 and m["step_s"] > 0.0 and m["overlap"] > 0.0
        assert st["median"]["odb"]["over_budget_batches"] == 0
        assert st["median"]["plain-fit"]["over_budget_batches"] == 0
    assert (e2e["settings"]["compute-bound"]["median"]["odb"]["compute_s"]
            > e2e["settings"]["data-bound"]["median"]["odb"]["compute_s"])


@BENCH_TIMEOUT
def test_readme_and_docs_sections_are_generated_from_results(bench, tmp_path):
    out, results, _ = bench
    readme, docs = tmp_path / "README.md", tmp_path / "benchmarks.md"
    shutil.copy(os.path.join(ROOT, "README.md"), readme)
    shutil.copy(os.path.join(ROOT, "docs", "benchmarks.md"), docs)
    script = os.path.join(ROOT, "scripts", "update_readme.py")
    gpu = os.path.join(ROOT, "docs", "results", "bench_gpu.json")  # the published GPU run (scripts/gpu_check.sh)
    args = [sys.executable, script, str(out / "results.json"), "--readme", str(readme), "--docs", str(docs),
            "--gpu", gpu]
    refused = subprocess.run(args, capture_output=True, text=True)
    assert refused.returncode == 2  # quick results are not for the README
    done = subprocess.run(args + ["--allow-quick"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    text, docs_text = readme.read_text(), docs.read_text()
    # README: the plot (drawn beside it from the results) and one table, a row per setting; the rest in docs
    assert (tmp_path / "docs" / "img" / "loss_vs_time.png").exists()
    assert "| convergence, 2 ranks, A = 8" in text and "Training speed" not in text
    for name in results["training"]["ranks2"]["workloads"]:
        assert f"| {name} (" in docs_text, name
    for name in results["planning"]["workloads"]:
        assert name in docs_text, name
    assert "Training speed" in docs_text and "Goals of the benchmark" in docs_text
    assert "### Goals" in docs_text
    assert not missing_citations(docs.read_text(), str(out)), "docs/benchmarks.md cites files that do not exist"
    check = args + ["--allow-quick", "--check"]
    assert subprocess.run(check, capture_output=True, text=True).returncode == 0
    # --check must catch a generated figure edited by hand, in either file, and write nothing
    gpu_results = json.load(open(gpu))
    assert "NVIDIA" in gpu_results["meta"]["machine"]["gpu"] and gpu_results["training"]["device"] == "cuda"
    for name in gpu_results["training"]["ranks1"]["workloads"]:
        assert f"| {name} (" in docs_text.split("<!-- odb-bench-gpu:begin")[1], name
    for path, begin in ((readme, "<!-- odb-plot:begin"), (readme, "<!-- odb-bench:begin"),
                        (docs, "<!-- odb-bench-summary:begin"), (docs, "<!-- odb-bench-tables:begin"),
                        (docs, "<!-- odb-bench-gpu:begin"), (docs, "<!-- odb-bench-gpu-tables:begin")):
        good = path.read_text()
        at = good.index(begin)
        digit = re.compile(r"\d\.\d").search(good, at)  # the first decimal figure of the generated section
        assert digit, f"no figure in the generated section of {path.name}"
        i = digit.start() + 2
        edited = good[:i] + str((int(good[i]) + 1) % 10) + good[i + 1:]
        path.write_text(edited)
        assert subprocess.run(check, capture_output=True, text=True).returncode == 1, path.name
        assert path.read_text() == edited, f"--check rewrote {path.name}"
        path.write_text(good)


@BENCH_TIMEOUT
def test_packing_figures(bench):
    """The packed-layout section: every sample in exactly one odb row, fills bounded by the lower bound; packed
    rows train padding-free with odb_varlen."""
    _, results, stdout = bench
    pk = results["packing"]
    assert "Packed layout" in stdout
    budget = pk["fill"]["token_budget"]
    for name, w in pk["fill"]["workloads"].items():
        o, t, f = w["odb-packed"], w["trl-bfd"], w["fixed-count"]
        assert o["every_sample_once"], name
        assert o["rows"] >= w["bound_rows"] and t["rows"] >= w["bound_rows"], name
        assert 0.0 < f["fill"] <= o["fill"] <= 1.0 and 0.0 < t["fill"] <= 1.0, name
        assert o["fill"] == pytest.approx(w["tokens"] / (o["rows"] * budget))
    assert "training" not in pk  # packed training is measured by the training section, beside padded batches
    arms = results["training"]["ranks2"]["workloads"]["heavy-tailed"]["arms"]
    for arm in ("odb_packed", "trl_packing"):
        assert arms[arm]["token_efficiency"] == 1.0 and arms[arm]["attention"] == "odb_varlen", arm


def test_published_figures_match_their_results_file():
    """README's and docs/benchmarks.md's generated sections are what docs/results/bench.json (the published
    `make demo` run) gives: a figure edited by hand, or a results file published without regenerating, fails."""
    results = os.path.join(ROOT, "docs", "results", "bench.json")
    assert os.path.exists(results), "docs/results/bench.json is missing. Fix: make demo && make publish"
    check = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "update_readme.py"), results,
                            "--readme", os.path.join(ROOT, "README.md"),
                            "--docs", os.path.join(ROOT, "docs", "benchmarks.md"), "--check"],
                           capture_output=True, text=True, cwd=ROOT)
    assert check.returncode == 0, ("README.md or docs/benchmarks.md differ from docs/results/bench.json. "
                                   "Fix: make publish (after make demo)\n" + check.stdout + check.stderr)

