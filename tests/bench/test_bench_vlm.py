"""The vision-language training section of the benchmark (odb.bench.vlm_training) at tiny sizes: every arm trains
every sample once, the same samples per optimizer step, within one memory cap; the figures are well-formed, the
tables render them and scripts/update_readme.py publishes them from the results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any, Dict

import pytest

from odb.bench import vlm_data as V
from odb.bench.report import render
from odb.bench.vlm_training import ARMS, ODB_ARMS, run_workload, worst

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def qwen() -> Dict[str, Any]:
    return run_workload("qwen2_vl", 1024, 16, 2, rounds=1)


def test_every_arm_trains_the_same_samples_per_step_within_the_cap(qwen: Dict[str, Any]) -> None:
    samples = V.vlm_samples("qwen2_vl", 16, seed=0, sides=(16, 160))
    tokens = sum(len(s["input_ids"]) for s in samples)
    patches = sum(int(s[V.PATCHES_KEY]) for s in samples)
    assert qwen["tokens"] == tokens and qwen["patches"] == patches > 0
    b, g = qwen["batch_size"], qwen["global_batch_size"]
    assert g == 2 * b and b == 1024 // qwen["max_length"] and qwen["max_image_patches"] >= b
    assert set(qwen["arms"]) == set(ARMS)
    for arm, m in qwen["arms"].items():
        assert m["samples"] == [16] and m["real_tokens"] == [tokens] and m["vision_patches"] == [patches], arm
        assert m["samples_per_step"]["all_but_last_equal_g"] and m["samples_per_step"]["max"] == g, arm
        assert m["steps"] == -(-16 // g), arm  # the same optimizer steps in every arm
        assert m["max_micro_batch_tokens"] <= 1024 and m["max_micro_batch_patches"] <= qwen["max_image_patches"], arm
        for key in ("tokens_per_s", "patches_per_s", "wall_s"):
            t = m[key]
            assert 0 < t["min"] <= t["median"] <= t["max"], (arm, key)
        assert m["patches_per_s"]["median"] == pytest.approx(patches / m["wall_s"]["median"])
        assert m["tokens_per_s_rounds"] == [pytest.approx(m["tokens_per_s"]["median"])]  # one round here
        assert 0.0 <= m["padding_share"] < 1.0
    assert qwen["arms"]["odb_packed"]["padding_share"] == 0.0  # one padding-free row per micro-batch
    assert qwen["arms"]["odb_packed"]["micro_steps"] <= qwen["arms"]["fixed"]["micro_steps"]
    assert qwen["arms"]["odb_padded"]["padding_share"] < qwen["arms"]["fixed"]["padding_share"]
    for o in ODB_ARMS:
        assert qwen["odb_over"][o]["fixed"] == pytest.approx(qwen["arms"][o]["tokens_per_s"]["median"]
                                                             / qwen["arms"]["fixed"]["tokens_per_s"]["median"])


def test_the_tables_and_the_readme_are_generated_from_the_results(qwen: Dict[str, Any], tmp_path: Any) -> None:
    from odb.bench.vlm_training import settings

    qwen = dict(qwen, settings=settings(qwen["batch_size"], qwen["accumulation"]))
    vlm = {"rounds": 1, "threads": 1, "sides": [16, 160], "model": {"hidden": 64, "layers": 2}, "lr": 1e-3,
           "arms": list(ARMS), "workloads": {"qwen2_vl": qwen}, "worst": worst({"qwen2_vl": qwen})}
    text = render({"vlm_training": vlm}, markdown=True)
    fixed = qwen["arms"]["fixed"]["tokens_per_s"]["median"]
    assert "## Vision-language training" in text and f"{fixed:,.0f} (" in text and "worst case, each odb arm" in text
    with open(os.path.join(ROOT, "docs", "results", "bench.json")) as f:
        published = json.load(f)
    published.pop("vlm_training", None)
    published["meta"].pop("vlm_run", None)
    results, run = tmp_path / "bench.json", tmp_path / "vlm.json"
    results.write_text(json.dumps(published))
    run.write_text(json.dumps({"meta": {"command": "python -m odb.bench --only-vlm", "quick": True, "git": {}},
                               "wall_s": {"total": 12.0}, "vlm_training": vlm}))
    readme, docs = tmp_path / "README.md", tmp_path / "benchmarks.md"
    readme.write_text(open(os.path.join(ROOT, "README.md")).read())
    docs.write_text(open(os.path.join(ROOT, "docs", "benchmarks.md")).read())
    args = [sys.executable, os.path.join(ROOT, "scripts", "update_readme.py"), str(results), "--readme", str(readme),
            "--docs", str(docs), "--gpu", "none", "--merge-vlm", str(run)]
    refused = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stderr  # a quick VLM run is not for the README
    done = subprocess.run(args + ["--allow-quick"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    block = docs.read_text().split("<!-- odb-bench-summary:begin")[1].split("<!-- odb-bench-summary:end")[0]
    assert "**Vision-language training**, from `python -m odb.bench --only-vlm` (" in block
    assert f"| {fixed:,.0f} |" in block and "Worst case, each odb arm" in block
    assert "## Vision-language training" in docs.read_text()
    assert "| vision-language, Qwen2-VL" in readme.read_text()  # README's table: a row per model
