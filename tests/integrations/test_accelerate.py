"""odb under Hugging Face Accelerate, Accelerator(cpu=True): one plain process (no process group,
as ``python train.py``) and 2 real gloo processes (dist_harness).

The gradient check: with gradient accumulation 1 and 2, every optimizer step of the
run (accelerator.prepare, accumulate, backward) leaves the float64 parameters equal to a
single process that steps over the union of that step's samples (ids from
info.sample_ids) with the token-mean loss.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

import accelerate  # noqa: F401  (pinned: a broken install fails, never skips)
import integration_workers as iw
from dist_harness import run_ranks
from helpers import known_lengths

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]

LENGTHS = known_lengths(45, 3, 30, seed=7)


TRAIN = dict(lengths=LENGTHS, budget=96, buffer=12, seed=4, lr=0.5, epochs=2, accumulation=[1, 2, 4])


def check_training(results: List[Dict[str, Any]], p: Dict[str, Any]) -> int:
    """Every rank's record of accelerate_train against the single-process reference; returns how many
    epochs ended in a shorter accumulation window."""
    world = len(results)
    partial_windows = 0
    for k in p["accumulation"]:
        runs = [r["runs"][k] for r in results]
        assert all(run["passed_through"] for run in runs), "accelerator.prepare replaced the odb loader"
        reference_steps, odb_params = [], []
        for epoch in range(p["epochs"]):
            per_rank = [run["epochs"][epoch] for run in runs]
            micro = [e["micro"] for e in per_rank]
            assert len({len(m) for m in micro}) == 1 and len(micro[0]) > 0, \
                "ranks ran different numbers of micro-batches"
            for rank_micro in micro:
                # accelerate.accumulate steps the optimizer exactly where odb's optimizer step ends
                assert [m["sync"] for m in rank_micro] == [m["last"] for m in rank_micro]
                for m in rank_micro:
                    assert m["ghost"] or m["idx"] == m["ids"]  # batches are odb's, moved to the device as-is
            partial_windows += sum(m["micro_steps"] < k for m in micro[0])
            emitted = sorted(i for e in per_rank for m in e["micro"] for i in m["ids"])
            assert emitted == list(range(len(LENGTHS))), "not every sample exactly once across the ranks"
            for e in per_rank:  # set_epoch reached the sampler
                assert e["sampler_epoch"] == epoch
            # the ranks iterated their shards (a step planned across ranks deals their samples among them)
            assert sorted(i for e in per_rank for i in e["sampler_order"]) == emitted
            steps = [e["steps"] for e in per_rank]
            assert len({len(rank_steps) for rank_steps in steps}) == 1
            for step in zip(*steps):
                for other in step[1:]:
                    for a, b in zip(step[0]["params"], other["params"]):
                        assert torch.equal(a, b), "DDP replicas diverged"
                reference_steps.append(sorted(i for rank_step in step for i in rank_step["ids"]))
                odb_params.append(step[0]["params"])
        assert runs[0]["epochs"][0]["sampler_order"] != runs[0]["epochs"][1]["sampler_order"]
        reference = iw.reference_run(LENGTHS, reference_steps, p["seed"], p["lr"])
        before = [q.detach() for q in iw.lm_model(p["seed"]).parameters()]
        error = 0.0
        for got, ref in zip(odb_params, reference):
            update = max(float((r - b).abs().max()) for r, b in zip(ref, before))
            error = max(error, max(float((g - r).abs().max()) for g, r in zip(got, ref)) / update)
            before = ref
        print(f"accelerate, {world} process(es), gradient_accumulation_steps={k}: {len(reference)} optimizer "
              f"steps, max relative parameter-update error {error:.2e}")
        assert error < 1e-6
    return partial_windows


def test_prepare_keeps_odb_batches_and_the_gradient_is_exact_with_accumulation(tmp_path):
    results = run_ranks("integration_workers:accelerate_train", 2, TRAIN, tmp_path, deadline_s=120)
    assert [r["num_processes"] for r in results] == [2, 2]
    assert check_training(results, TRAIN) > 0, \
        "no epoch ended in a shorter accumulation window: the data does not test it"


def test_global_batch_size_keeps_the_users_samples_per_step(tmp_path):
    """global_batch_size = 3 x accumulation x 2 ranks: accelerator.accumulate steps exactly where odb's steps
    end (configure_accelerator raised its count to what a step can hold), every step holds those samples,
    and the parameters follow the single-process reference."""
    p = dict(TRAIN, same_updates=True)
    results = run_ranks("integration_workers:accelerate_train", 2, p, tmp_path, deadline_s=120)
    check_training(results, p)
    for k in p["accumulation"]:
        for epoch in range(p["epochs"]):
            sizes = [len(a["ids"]) + len(b["ids"]) for a, b in zip(results[0]["runs"][k]["epochs"][epoch]["steps"],
                                                                    results[1]["runs"][k]["epochs"][epoch]["steps"])]
            g = 3 * k * 2
            assert sizes == [g] * (len(LENGTHS) // g) + ([len(LENGTHS) % g] if len(LENGTHS) % g else [])


def run_one_process(worker: str, p: Dict[str, Any], tmp: Path) -> Any:
    """``integration_workers.<worker>(0, 1, p)`` in a fresh interpreter with no process group and no launcher
    variables, as ``python train.py`` runs."""
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "params.json").write_text(json.dumps(p))
    code = ("import json, sys, torch, integration_workers as iw; "
            f"torch.save(iw.{worker}(0, 1, json.loads(open(sys.argv[1]).read())), sys.argv[2])")
    launcher = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
    env = {k: v for k, v in os.environ.items() if k not in launcher}
    proc = subprocess.run([sys.executable, "-c", code, str(tmp / "params.json"), str(tmp / "result.pt")],
                          cwd=str(Path(__file__).resolve().parents[1] / "support"), env=dict(env, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{worker} in one process failed:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
    return torch.load(tmp / "result.pt", weights_only=False)


def test_one_process_prepare_keeps_odb_batches_and_the_gradient_is_exact_with_accumulation(tmp_path):
    result = run_one_process("accelerate_train", TRAIN, tmp_path)
    assert (result["num_processes"], result["distributed_type"]) == (1, "NO")
    check_training([result], TRAIN)


def test_resume_skip_first_batches_and_clear_errors(tmp_path):
    # windows of 4-8 samples: the 22 samples of a rank arrive in several windows, so resuming must also skip
    # the consumed part of the sampler's epoch-1 order
    p = dict(lengths=LENGTHS, budget=96, buffer=8, first_window=4, skip=3, checkpoint=str(tmp_path / "ckpt"))
    results = run_ranks("integration_workers:accelerate_resume", 2, p, tmp_path / "run", deadline_s=120)
    for rank, r in enumerate(results):
        assert len(r["reference"]) > p["skip"] + 1
        assert r["skipped"] == r["reference"][p["skip"]:], f"rank {rank}: skipping re-planned other batches"
        assert r["resumed"] == r["reference"][p["skip"]:], f"rank {rank}: save_state/load_state lost its place"
        errors = r["errors"]
        assert "gradient_accumulation_steps=2" in errors["accumulation"] and "Fix:" in errors["accumulation"]
        assert errors["unsharded"].startswith("ValueError") and "ShardSampler" in errors["unsharded"]
        assert errors["not_odb"].startswith("TypeError") and "odb.apply" in errors["not_odb"]
        assert errors["accelerate_skip"].startswith("AttributeError") and "skip_first_batches" in \
            errors["accelerate_skip"]


def test_import_odb_does_not_import_the_frameworks():
    code = ("import sys, odb, odb.integrations; "
            "print(sorted(m for m in ('accelerate', 'lightning', 'pytorch_lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("device", [None, "cpu"], ids=["same-batch", "moved-to-device"])
def test_a_forgotten_pop_under_accelerate_is_warned_once_with_the_fix(device, recwarn):
    """The wrapper takes the info off and puts it on the batch it yields (a device copy): the loop must pop it."""
    import odb
    from helpers import LengthDataset, pad_collate
    from odb.integrations.accelerate import ODBAcceleratedLoader
    from odb.step_info import StepInfoNotPoppedWarning

    def run(pop: bool) -> List[Any]:
        recwarn.clear()
        loader = odb.ODBDataLoader(LengthDataset(LENGTHS), token_budget=96, buffer_size=12, collate_fn=pad_collate)
        wrapped = ODBAcceleratedLoader(loader, None if device is None else torch.device(device))
        for epoch in range(2):
            wrapped.set_epoch(epoch)
            for batch in wrapped:
                assert "odb_step_info" in batch
                if pop:
                    odb.pop_step_info(batch)
        return [w for w in recwarn.list if issubclass(w.category, StepInfoNotPoppedWarning)]

    [warning] = run(pop=False)
    assert "info = odb.pop_step_info(batch)" in str(warning.message)
    assert "odb.integrations.accelerate.scale_loss(accelerator, loss, info)" in str(warning.message)
    assert run(pop=True) == []
