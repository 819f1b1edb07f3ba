"""Elastic resume through the integrations: a checkpoint saved by W processes resumes on W'
processes (2 -> 1, 1 -> 2, 2 -> 3) in Accelerate (save_state / load_state), the HF Trainer
(resume_from_checkpoint) and Lightning (Trainer.fit(ckpt_path=...)).

Each phase is a fresh set of real gloo processes (dist_harness; Lightning: ddp_spawn), as
after a restart. Every phase records the sample ids of every optimizer step on its rank;
the interrupted epoch must train every sample exactly once over both phases (none twice,
none lost), and the next epoch every sample once on the new world.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any, Dict, List

import pytest
import torch

import elastic_integration_workers  # noqa: F401  (the harness imports it by name in the ranks)
from dist_harness import run_ranks
from helpers import known_lengths

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

LENGTHS = known_lengths(45, 3, 30, seed=7)


def once(ids: List[int], n: int, what: str) -> None:
    counts = Counter(ids)
    twice = sorted(i for i, c in counts.items() if c > 1)
    lost = sorted(set(range(n)) - set(counts))
    assert not twice and not lost and len(ids) == n, f"{what}: trained twice {twice}, never {lost}"


# ---- Accelerate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 3)])
def test_accelerate_save_state_resumes_on_another_number_of_processes(tmp_path, before, after):
    p = dict(lengths=LENGTHS, budget=96, buffer=12, seed=4, lr=0.5, accumulation=2)
    ckpt = str(tmp_path / "ckpt")
    first = run_ranks("elastic_integration_workers:accelerate_phase", before, dict(p, stop=2, save_to=ckpt),
                      tmp_path / "first", deadline_s=120)
    rest = run_ranks("elastic_integration_workers:accelerate_phase", after, dict(p, load_from=ckpt),
                     tmp_path / "rest", deadline_s=120)
    assert all(len(r["steps"]) == 2 for r in first)
    assert len({len(r["steps"]) for r in rest}) == 1, "the new ranks ran different numbers of optimizer steps"
    for phase, world in ((first, before), (rest, after)):
        for column in zip(*(r["steps"] for r in phase)):  # exact loss scaling on every step of both worlds
            assert sum(s["scale"] for s in column) == pytest.approx(world)
    done = [i for r in first for s in r["steps"] for i in s["ids"]]
    resumed = [i for r in rest for s in r["steps"] if s["epoch"] == 0 for i in s["ids"]]
    assert done and resumed
    once(done + resumed, len(LENGTHS), f"epoch 0 saved by {before} and resumed by {after} processes")
    once([i for r in rest for s in r["steps"] if s["epoch"] == 1 for i in s["ids"]], len(LENGTHS), "epoch 1")


# ---- HF Trainer ---------------------------------------------------------------------------------


def hf_params(out: str, **kw: Any) -> Dict[str, Any]:
    p = dict(model="llama", n=32, ga=2, lr=1e-2, budget=60, max_steps=-1, epochs=2, out=out,
             args=dict(save_strategy="steps", save_steps=2, optim="adamw_torch", lr_scheduler_type="linear",
                       warmup_steps=1))
    p.update(kw)
    return p


def epoch_of(steps: List[Any], epoch: int) -> List[int]:
    """Sample ids of the recorded steps (global_step, epoch, ids, lr) that belong to ``epoch``."""
    return [i for (_, e, ids, _) in steps if epoch < e <= epoch + 1 for i in ids]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2)])
def test_hf_trainer_resumes_a_checkpoint_on_another_number_of_processes(tmp_path, before, after):
    first = run_ranks("elastic_integration_workers:hf_phase", before, hf_params(str(tmp_path / "first")),
                      tmp_path / "h1", deadline_s=240)
    ckpt = os.path.join(str(tmp_path / "first"), "checkpoint-2")
    saved = sorted(f for f in os.listdir(ckpt) if f.startswith("odb_state_rank"))
    assert saved == [f"odb_state_rank{r}.json" for r in range(before)]
    rest = run_ranks("elastic_integration_workers:hf_phase", after, hf_params(str(tmp_path / "rest"), resume=ckpt),
                     tmp_path / "h2", deadline_s=240)
    done = [i for r in first for (step, _, ids, _) in r["steps"] if step <= 2 for i in ids]
    assert 0 < len(done) < 32 and all(r["steps"][1][1] < 1.0 for r in first)  # checkpoint-2 is mid-epoch
    for r in rest:
        assert [s[0] for s in r["steps"]][:1] == [3], "the resumed run did not continue at step 3"
        assert r["steps"][-1][1] == pytest.approx(2.0) and r["steps"][-1][3] == pytest.approx(0.0)  # ran to the end
    once(done + [i for r in rest for i in epoch_of(r["steps"], 0)], 32,
         f"epoch 0 saved by {before} and resumed by {after} processes")
    once([i for r in rest for i in epoch_of(r["steps"], 1)], 32, "epoch 1")


# ---- Lightning ----------------------------------------------------------------------------------


def lightning_fit(tmp_path, monkeypatch, world: int, **overrides: Any) -> List[Dict[str, Any]]:
    """Trainer.fit with ddp_spawn on ``world`` CPU processes (integration_workers.LitLM over a ShardSampler)."""
    import integration_workers as iw
    import lightning.pytorch  # noqa: F401  (pinned under `make test` and test-min: a broken install fails)
    from dist_harness import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out = tmp_path / "out"
    out.mkdir(parents=True, exist_ok=True)
    p = dict(world=world, lengths=LENGTHS, budget=96, buffer=12, seed=4, lr=0.5, epochs=2, accumulation=2,
             out=str(out), snapshot_every=1)
    p.update(overrides)
    iw.lightning_fit(p)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def test_lightning_checkpoint_resumes_on_another_number_of_processes(tmp_path, monkeypatch):
    ckpt = str(tmp_path / "mid.ckpt")
    first = lightning_fit(tmp_path / "first", monkeypatch, 2, max_steps=2, checkpoint_at=2, checkpoint=ckpt)
    rest = lightning_fit(tmp_path / "rest", monkeypatch, 1, resume_from=ckpt)
    done = [i for r in first for m in r["micro"] for i in m["ids"]]
    assert 0 < len(done) < len(LENGTHS)
    once(done + [i for m in rest[0]["micro"] if m["epoch"] == 0 for i in m["ids"]], len(LENGTHS),
         "epoch 0 saved by 2 and resumed by 1 process")
    once([i for m in rest[0]["micro"] if m["epoch"] == 1 for i in m["ids"]], len(LENGTHS), "epoch 1")
    # with snapshot_every > 1 the checkpoint holds batches to replay, which only the saved ranks can
    ckpt3 = str(tmp_path / "replay.ckpt")
    lightning_fit(tmp_path / "first3", monkeypatch, 2, max_steps=2, checkpoint_at=2, checkpoint=ckpt3,
                  snapshot_every=3)
    with pytest.raises(Exception, match=r"resumes on 2 processes, not 1\. Fix: .*snapshot_every=1"):
        lightning_fit(tmp_path / "rest3", monkeypatch, 1, resume_from=ckpt3, snapshot_every=3)
