"""With the user's batch (enable_odb's default) the Trainer's own schedule runs unchanged.

The same float64 tiny Llama trains twice, with the Trainer as it is and with ``enable_odb``: 250 samples
in batches of 4 x 2 accumulated, so each epoch's last optimizer step holds 2 samples, read in order so
that both runs put the same samples in every optimizer step (odb cuts them into micro-batches of its
own under a budget of 60 tokens). The learning rate after every step must be the Trainer's, exactly,
and the whole run's parameter update the Trainer's to 1e-5 relative (transformers computes the Llama
loss in float32): under linear, cosine and warmup schedules, over whole and fractional epochs, with
``max_steps``, across a resume in the middle of an epoch, on 1 and 2 gloo ranks, and in TRL's
SFTTrainer (LLaMA-Factory's trainer: tests/integrations/test_llamafactory.py). Before, odb read the
schedule at the share of samples seen, and the updates differed by 1.2e-2 (linear, 1 rank).
"""

from __future__ import annotations

import os

import pytest

import schedule_workers as S
from dist_harness import run_ranks

GAP = 1e-5  # the Llama loss runs in float32 inside transformers; the runs agree to about 1e-8
N = 250  # 31 steps of 8 samples and one of 2 per epoch


def compare(plain: dict, odb: dict) -> float:
    assert S.same_start(plain, odb)
    assert odb["global_step"] == plain["global_step"] and odb["max_steps"] == plain["max_steps"]
    assert odb["rates"] == plain["rates"], "odb's learning rates are not the Trainer's"
    assert max(odb["micro"]) > 2, "odb did not cut the steps into micro-batches of its own"
    gap = S.update_gap(plain, odb)
    assert gap <= GAP, f"relative update gap {gap:.2e}"
    return gap


def both(tmp_path, **p) -> tuple:
    plain = S.run(0, 1, dict(p, out=str(tmp_path / "plain")))
    return plain, S.run(0, 1, dict(p, odb=True, out=str(tmp_path / "odb")))


SCHEDULES = {"linear-warmup": dict(lr_scheduler_type="linear", warmup_steps=5),
             "cosine-warmup-share": dict(lr_scheduler_type="cosine", warmup_steps=0.1),
             "constant-with-warmup": dict(lr_scheduler_type="constant_with_warmup", warmup_steps=7)}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_the_trainers_schedule_runs_unchanged_over_epochs_with_a_partial_last_step(tmp_path, name):
    plain, odb = both(tmp_path, n=N, args=SCHEDULES[name])
    assert plain["global_step"] == 2 * 32
    print(f"{name}: 1 process, {plain['global_step']} steps, relative update gap {compare(plain, odb):.2e}")


def test_fractional_epochs_and_max_steps_stop_where_the_trainer_does(tmp_path):
    plain, odb = both(tmp_path / "epochs", n=N, epochs=1.5, args=dict(lr_scheduler_type="linear", warmup_steps=3))
    assert plain["global_step"] == 48  # ceil(1.5 x 32), as the Trainer counts
    compare(plain, odb)
    plain, odb = both(tmp_path / "steps", n=N, max_steps=45, args=dict(lr_scheduler_type="cosine", warmup_steps=4))
    assert plain["global_step"] == 45  # into the second epoch
    print(f"max_steps=45: relative update gap {compare(plain, odb):.2e}")


def test_resume_in_the_middle_of_an_epoch_keeps_the_schedule(tmp_path):
    args = dict(lr_scheduler_type="linear", warmup_steps=5, save_strategy="steps", save_steps=20)
    plain, odb = both(tmp_path, n=N, args=args)
    compare(plain, odb)
    resumed = S.run(0, 1, dict(n=N, args=args, odb=True, out=str(tmp_path / "resumed"),
                               resume=os.path.join(str(tmp_path / "odb"), "checkpoint-20")))
    assert resumed["rates"] == plain["rates"][20:]
    resumed["before"] = plain["before"]  # the update of the whole run, resumed at step 20 of 32
    gap = S.update_gap(plain, resumed)
    print(f"resumed at step 20 (mid-epoch): relative update gap {gap:.2e}")
    assert gap <= GAP


@pytest.mark.dist
def test_two_ranks_keep_the_trainers_schedule(tmp_path):
    # even_batches=False: the plain Trainer's accelerate loader would otherwise fill the last batches with
    # samples from the start of the epoch, which odb does not repeat
    runs = []
    for name in ("linear-warmup", "cosine-warmup-share"):
        args = dict(SCHEDULES[name], accelerator_config={"even_batches": False})
        runs += [dict(n=N, args=args), dict(n=N, args=args, odb=True)]
    ranks = run_ranks("schedule_workers:suite", 2, {"runs": runs, "out": str(tmp_path / "out")}, tmp_path / "h",
                      deadline_s=280)
    for rank, results in enumerate(ranks):
        for k in range(0, len(runs), 2):
            plain, odb = results[k], results[k + 1]
            assert plain["global_step"] == 2 * 16
            print(f"2 ranks, rank {rank}, {runs[k]['args']['lr_scheduler_type']}: relative update gap "
                  f"{compare(plain, odb):.2e}")


@pytest.mark.trl
def test_trl_sft_trainer_keeps_its_schedule(tmp_path):
    # 50 prompt-completion samples: 6 steps of 8 and one of 2 per epoch
    plain, odb = both(tmp_path, trainer="sft", n=50, budget=120,
                      args=dict(lr_scheduler_type="cosine", warmup_steps=2))
    assert plain["global_step"] == 2 * 7
    print(f"TRL SFTTrainer: relative update gap {compare(plain, odb):.2e}")
