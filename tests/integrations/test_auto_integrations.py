"""token_budget="auto" through the integrations, on the real frameworks, 1 process and 2 gloo processes.

For the HF Trainer, TRL's SFTTrainer and Accelerate: one epoch of a tiny random-weight
model (built from a config, CPU) under a memory cap several times the first batches' activation
memory. The run must end with the same number of steps on every rank, the budget must have grown
from its start (``auto_start_budget``) after measured steps (``auto_observed_steps``), every
step's measured activation memory (``Recording`` around the loader's meter) must stay under the
cap, and the loss must be finite. On CPU the HF Trainer and TRL default ``memory_meter`` to
``ActivationMeter(trainer.model)`` (odb.integrations.memory); Accelerate takes the user's meter (the
loader is built before the integration sees the model). Lightning and the HF Trainer fetch batches
ahead of training them (Lightning one ahead; the Trainer a whole optimizer step's micro-batches), so
their integrations measure each batch around its own training (AutoControl.begin/end), which the
fitted model's small error shows (measured at next(), the peaks went to other batches' shapes).
The workers are in tests/support/auto_integration_workers.py.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

import accelerate  # noqa: F401  (pinned: a broken install fails, never skips)
import auto_integration_workers as A
from dist_harness import run_ranks
from helpers import known_lengths

START = 48  # auto_start_budget: the first windows' budget (tokens)
LENGTHS = known_lengths(160, 3, 30, seed=5)
# The tiny LM saves ~72 bytes a token (its embedding output and the ids): START tokens ~ 3.5 KB
LM = dict(lengths=LENGTHS, cap=40_000, start=START, buffer=24, seed=4, lr=0.1)
# The tiny Llama saves ~5 KB a token: START tokens ~ 240 KB
LLAMA = dict(n=64, cap=2_000_000, start=START, buffer=16)
# TRL's prepared samples (a few words each) through the same Llama: START tokens ~ 30 KB
SFT = dict(LLAMA, cap=400_000)


def check_auto(ranks: List[Dict[str, Any]], cap: int, samples: int) -> None:
    """The checks every integration's run must pass (see the module docstring)."""
    assert len({r["steps"] for r in ranks}) == 1 and ranks[0]["steps"] > 0, \
        f"ranks took {[r['steps'] for r in ranks]} steps"
    assert sorted(i for r in ranks for i in r["samples"]) == list(range(samples)), "not every sample once"
    for rank, r in enumerate(ranks):
        assert r["auto_cap"] == cap
        assert r["observed"] > 0, f"rank {rank}: no step was measured"
        assert r["window_budget"] > START and max(r["padded"]) > START, \
            f"rank {rank}: the budget did not grow from {START} (windows up to {r['window_budget']}, " \
            f"batches up to {max(r['padded'])} tokens)"
        assert len(r["peaks"]) >= r["steps"] - r["ghosts"] - 1, f"rank {rank}: steps without a measurement"
        assert max(r["peaks"]) < cap, f"rank {rank}: a step used {max(r['peaks']):.0f} bytes, cap {cap}"
        assert A.finite(r["losses"]), f"rank {rank}: losses {r['losses']}"


# ---- HF Trainer --------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_hf_trainer_auto_one_process(tmp_path):
    r = A.hf_auto(0, 1, dict(LLAMA, out=str(tmp_path)))
    assert r["default_meter"] == "ActivationMeter"  # no memory_meter passed, no CUDA: the Trainer's model's
    assert r["global_step"] == r["steps"]
    check_auto([r], LLAMA["cap"], LLAMA["n"])


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_hf_trainer_auto_two_processes(tmp_path):
    p = dict(LLAMA, n=2 * LLAMA["n"], out=str(tmp_path / "out"))  # each rank as many samples as one process
    ranks = run_ranks("auto_integration_workers:hf_auto", 2, p, tmp_path / "h", deadline_s=80)
    assert all(r["default_meter"] == "ActivationMeter" for r in ranks)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == ranks[0]["steps"]
    check_auto(ranks, LLAMA["cap"], p["n"])


@pytest.mark.timeout(60)
def test_hf_trainer_auto_with_gradient_accumulation_measures_each_micro_batch(tmp_path):
    """The Trainer pulls a step's micro-batches before it trains them: each is measured around its own
    training_step (measured at next(), every peak went to the step's last micro-batch's shape)."""
    r = A.hf_auto(0, 1, dict(LLAMA, ga=2, out=str(tmp_path)))
    check_auto([r], LLAMA["cap"], LLAMA["n"])
    assert r["relative_error"] < 0.05, r["relative_error"]


@pytest.mark.timeout(60)
def test_hf_trainer_auto_refusal_and_kept_meter(tmp_path):
    out = A.hf_refusals(0, 1, {"out": str(tmp_path)})
    assert "memory_cap_bytes" in out["no_cap"] and "Fix" in out["no_cap"]  # the refusal names the fix
    assert out["kept"] == "True"  # a meter the user passes is used as it is
    assert out["int_budget"] == "None"  # an int budget: no meter


# ---- TRL SFTTrainer ----------------------------------------------------------------------------------


@pytest.mark.trl
@pytest.mark.timeout(60)
def test_trl_sft_auto_one_process(tmp_path):
    r = A.trl_auto(0, 1, dict(SFT, out=str(tmp_path)))
    assert r["default_meter"] == "ActivationMeter"
    check_auto([r], SFT["cap"], SFT["n"])


@pytest.mark.trl
@pytest.mark.dist
@pytest.mark.timeout(90)
def test_trl_sft_auto_two_processes(tmp_path):
    # smaller windows than one process's: the measured steps reach the plan a few windows before each rank's
    # epoch ends (the Trainer holds a step's micro-batches and one more before it trains them)
    p = dict(SFT, n=2 * SFT["n"], buffer=8, out=str(tmp_path / "out"))
    ranks = run_ranks("auto_integration_workers:trl_auto", 2, p, tmp_path / "h", deadline_s=80)
    assert all(r["default_meter"] == "ActivationMeter" for r in ranks)
    check_auto(ranks, SFT["cap"], p["n"])


# ---- Accelerate ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_accelerate_auto_one_process():
    check_auto([A.accelerate_auto(0, 1, LM)], LM["cap"], len(LENGTHS))


@pytest.mark.dist
@pytest.mark.timeout(90)
def test_accelerate_auto_two_processes(tmp_path):
    ranks = run_ranks("auto_integration_workers:accelerate_auto", 2, LM, tmp_path, deadline_s=80)
    check_auto(ranks, LM["cap"], len(LENGTHS))


# ---- Lightning ------------------------------------------------------------------------------------------



def check_lightning(ranks: List[Dict[str, Any]], samples: int) -> None:
    """A Lightning fit under "auto": equal steps, every sample once, the budget grew, every step under the cap."""
    assert len({len(r["micro"]) for r in ranks}) == 1 and ranks[0]["micro"], "ranks trained other batch counts"
    assert sorted(i for r in ranks for m in r["micro"] for i in m["ids"]) == list(range(samples))
    for rank, r in enumerate(ranks):
        auto = r["auto"]
        assert auto["auto_cap"] == LM["cap"] and auto["auto_observed_steps"] == len(r["micro"]), auto
        assert auto["auto_window_budget"] > START and max(m["padded"] for m in r["micro"]) > START
        assert len(r["peaks"]) >= len(r["micro"]) - sum(m["ghost"] for m in r["micro"]) - 1
        assert max(r["peaks"]) < LM["cap"], f"rank {rank}: a step used {max(r['peaks']):.0f} bytes"
        # each measurement is its own batch's: the fitted memory per token is the model's (Lightning
        # fetches a batch ahead; measured at next() the peaks went to the next batch's shape)
        assert auto["auto_memory_relative_error"] < 0.05, auto


@pytest.mark.timeout(90)
def test_lightning_auto_one_process(tmp_path):
    import lightning.pytorch as pl  # pinned: a broken install fails, never skips

    import integration_workers as iw
    from odb.integrations.lightning import ODBCallback

    p = dict(LM, budget="auto", accumulation=2, out=str(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=1, accumulate_grad_batches=2,
                         callbacks=[ODBCallback(budget_filled_steps=True)], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(iw.LitLM(p))
    import torch

    check_lightning([torch.load(tmp_path / "rank0.pt", weights_only=False)], len(LENGTHS))


@pytest.mark.dist
@pytest.mark.timeout(150)
def test_lightning_auto_two_processes(tmp_path, monkeypatch):
    import torch

    import integration_workers as iw
    from dist_harness import free_port

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    iw.lightning_fit(dict(LM, world=2, budget="auto", accumulation=2, epochs=1, out=str(tmp_path)))
    check_lightning([torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)], len(LENGTHS))
