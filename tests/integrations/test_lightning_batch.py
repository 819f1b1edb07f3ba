"""Lightning's automatic optimisation keeps the user's batch: ``ODBDataLoader(batch_size=B)`` with
``accumulate_grad_batches=A`` trains exactly what a plain ``DataLoader(batch_size=B)`` trains.

The two runs (tests/support/lightning_workers.py) read 36 samples in order, B = 4, A = 2, 2 epochs, so an
optimizer step holds 4 x 2 x world samples and each epoch ends with a partial step; odb cuts every step
into micro-batches of its own under a budget of 60 tokens (2 to 6 where Lightning's DataLoader has 2). A
learning rate that decays every optimizer step (``interval="step"``) and gradient clipping that clips
ride along, so any count of micro-batches where Lightning counts optimizer steps shows up in the float64
parameters, compared after every optimizer step; so do the global step, the logging step and the steps
ModelCheckpoint(every_n_train_steps=3) saves at. A run checkpointed in the middle of its second epoch and
resumed from it must continue to the same parameters.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest
import torch

import lightning.pytorch  # noqa: F401  (pinned: a broken install fails, never skips)
import lightning_workers as L
from dist_harness import run_ranks
from helpers import known_lengths

pytestmark = pytest.mark.timeout(240)

EXACT = 1e-9  # float64 throughout; measured about 5e-14
BASE = dict(lengths=known_lengths(36, 3, 30, seed=11), batch=4, accumulation=2, budget=60, seed=4, lr=0.5, epochs=2,
            clip=0.05)


def runs(checkpoint: str, at: int) -> List[Dict[str, Any]]:
    """Plain, odb, odb stopped at step ``at`` with a checkpoint, odb resumed from it."""
    return [dict(BASE, odb=False), dict(BASE, odb=True),
            dict(BASE, odb=True, max_steps=at, checkpoint_at=at, checkpoint=checkpoint, snapshot_every=3),
            dict(BASE, odb=True, resume_from=checkpoint, snapshot_every=3)]


def update_error(plain: List[Dict[str, Any]], odb: List[Dict[str, Any]]) -> float:
    """max over optimizer steps of |odb's parameters - the plain run's| / the plain step's largest update."""
    before = [q.detach() for q in L.lm_model(BASE["seed"]).parameters()]
    error = 0.0
    for a, b in zip(plain, odb):
        update = max(float((x - y).abs().max()) for x, y in zip(a["params"], before))
        error = max(error, max(float((x - y).abs().max()) for x, y in zip(a["params"], b["params"])) / update)
        before = a["params"]
    return error


def check(results: List[Dict[str, Any]], at: int, steps_per_epoch: int, what: str) -> None:
    plain, odb, first, resumed = results
    total = 2 * steps_per_epoch
    assert plain["global_step"] == odb["global_step"] == total == resumed["global_step"]
    assert [r["step"] for r in odb["records"]] == list(range(1, total + 1))
    assert [r["lr"] for r in odb["records"]] == [r["lr"] for r in plain["records"]], "odb's schedule is not Lightning's"
    assert any(m != BASE["accumulation"] for m in odb["micro"]), "odb did not cut the steps its own way"
    assert odb["accumulation"] == BASE["accumulation"], "the Trainer's accumulate_grad_batches was not given back"
    logged = sorted(set(odb["logged"]))
    assert logged == sorted(set(plain["logged"])) == list(range(total)), "the logging step is not the optimizer step"
    error = update_error(plain["records"], odb["records"])
    # the resumed run: checkpointed at step `at` (mid-epoch), it continues with the plain run's steps
    assert 0 < at % steps_per_epoch and first["global_step"] == at
    assert [r["step"] for r in resumed["records"]] == list(range(at + 1, total + 1))
    assert sorted(set(resumed["logged"])) == list(range(at, total))
    resumed_error = update_error(plain["records"], first["records"] + resumed["records"])
    print(f"lightning {what}: {total} optimizer steps, micro-batches per step {odb['micro']} (plain: "
          f"{BASE['accumulation']}), max relative update error {error:.1e}, resumed at step {at}: {resumed_error:.1e}")
    assert error <= EXACT and resumed_error <= EXACT


def test_one_process_trains_the_plain_dataloaders_updates(tmp_path):
    plan = runs(str(tmp_path / "mid.ckpt"), at=7)
    plan[1]["checkpoints"] = str(tmp_path / "every3")  # ModelCheckpoint(every_n_train_steps=3)
    results = L.suite(0, 1, {"runs": plan})
    check(results, 7, 5, "1 process")
    assert sorted(os.listdir(tmp_path / "every3")) == ["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt",
                                                       "epoch=1-step=9.ckpt"]
    plain, odb = results[:2]
    assert [r["ids"] for r in odb["records"]] == [r["ids"] for r in plain["records"]]  # the same samples per step


@pytest.mark.dist
def test_two_processes_train_the_plain_dataloaders_updates(tmp_path):
    ranks = run_ranks("lightning_workers:suite", 2, {"runs": runs(str(tmp_path / "mid.ckpt"), at=4)}, tmp_path / "h",
                      deadline_s=230)
    for rank, results in enumerate(ranks):
        check(results, 4, 3, f"2 processes, rank {rank}")
    for k in range(len(ranks[0])):  # the replicas stay equal
        for a, b in zip(ranks[0][k]["records"], ranks[1][k]["records"]):
            assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


def test_manual_optimisation_keeps_working_and_stepping_inside_odbs_step_is_refused(tmp_path):
    """Manual optimisation (accumulate_grad_batches=1, as Lightning requires there): ODBDataLoader(batch_size=4,
    gradient_accumulation_steps=2), the module stepping at is_last_micro_step, trains the plain run's updates;
    a module that steps after every batch is stopped at the first, with every setting to change."""
    manual = dict(BASE, odb=True, manual="last", accumulation=1, loader={"gradient_accumulation_steps": 2}, clip=None)
    plain, odb = L.suite(0, 1, {"runs": [dict(BASE, odb=False, clip=None), manual]})  # no clipping under manual
    assert odb["global_step"] == plain["global_step"] == 10
    assert update_error(plain["records"], odb["records"]) <= EXACT
    with pytest.raises(RuntimeError, match=r"stepped the optimizer after micro-batch 1 of \d+ of odb's optimizer step 0"
                                           r".*only when self\.odb_step_info\.is_last_micro_step.*"
                                           r"accumulate_grad_batches=1"):
        L.fit(0, 1, dict(manual, manual="each"))


@pytest.mark.parametrize("case,error", [
    # no batch_size: budget-filled steps, never silently
    ({"loader": {"batch_size": None, "gradient_accumulation_steps": 2}},
     r"built without batch_size .*budget-filled steps only when asked for by name.*batch_size=B, "
     r"gradient_accumulation_steps=self\.trainer\.accumulate_grad_batches.*ODBCallback\(budget_filled_steps=True\)"),
    ({"manual": "last", "accumulation": 1, "clip": None, "loader": {"batch_size": None}},
     r"Trainer\(accumulate_grad_batches=1\) \(Lightning's own accumulation is off under manual optimisation\)"),
    # the loader's step is not the Trainer's: batch_size=4 without the Trainer's 2 accumulated batches
    ({"loader": {"gradient_accumulation_steps": 1}},
     r"global_batch_size=4 .*batch_size=4 x accumulate_grad_batches=2 x 1 process\(es\) = 8.*"
     r"gradient_accumulation_steps=self\.trainer\.accumulate_grad_batches \(= 2\).*accumulate_grad_batches=1\)"),
    ({"callback": {"budget_filled_steps": True}}, r"budget_filled_steps=True\) got an odb loader that keeps "
                                                  r"global_batch_size=8"),
    ({"gas": True}, r"GradientAccumulationScheduler.*accumulate_grad_batches=2\)"),
])
def test_settings_that_change_the_users_step_are_refused_with_the_fix(tmp_path, case, error):
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    p = dict(BASE, odb=True, epochs=1, **{k: v for k, v in case.items() if k != "gas"})
    if case.get("gas"):
        p["callbacks"] = [GradientAccumulationScheduler({0: 2})]
    with pytest.raises(ValueError, match=error):
        L.fit(0, 1, p)


def test_a_train_dataloader_reloaded_every_epoch_keeps_the_users_batch(tmp_path):
    """reload_dataloaders_every_n_epochs=1: train_dataloader() runs again before each epoch and reads the Trainer's
    own accumulate_grad_batches (given back at each epoch's end); the updates stay the plain run's."""
    plain, odb = L.suite(0, 1, {"runs": [dict(BASE, odb=False), dict(BASE, odb=True, reload=True)]})
    assert odb["global_step"] == plain["global_step"] == 10
    assert update_error(plain["records"], odb["records"]) <= EXACT


def test_budget_filled_steps_asked_for_by_name_step_every_accumulate_grad_batches(tmp_path):
    p = dict(BASE, odb=True, epochs=1, callback={"budget_filled_steps": True},
             loader={"batch_size": None, "gradient_accumulation_steps": 2})
    odb = L.fit(0, 1, p)
    assert set(odb["micro"][:-1]) == {2} and sum(len(r["ids"]) for r in odb["records"]) == 36
