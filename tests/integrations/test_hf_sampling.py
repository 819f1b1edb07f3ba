"""Under ``enable_odb`` the Trainer's ``train_sampling_strategy`` keeps its optimizer steps: ``group_by_length``
and ``batch_rebalance`` train each step on exactly the samples the same Trainer trains on without odb, on any
number of ranks, and odb only cuts them into micro-batches (odb.integrations.hf.sampling).

The same float64 tiny model trains twice over two epochs, with the Trainer as it is and with ``enable_odb``
(tests/support/schedule_workers.py), and the whole run's parameter update must be the Trainer's to 1e-5
relative (transformers computes the Llama loss in float32; the runs agree to about 1e-8), padded and in odb's
packed rows (the update is the token mean of the same samples either way). group_by_length draws its
permutation from torch's global RNG each epoch, so torch's RNG state after training must be the Trainer's
too: one draw more or less anywhere moves every step's samples (measured: an extra ``torch.rand(1)`` per epoch
took the gap to 1.5e-1; odb's own ``"random"`` steps against group_by_length's give 2.4e-1). The ends of the
epoch are Accelerate's: its default ``even_batches=True`` (which fills the last round of batches with samples
from the epoch's start) and ``dataloader_drop_last=True`` (which drops an incomplete last round) give the
Trainer's steps (``even_batches=False`` too: measured 1.1e-8 on 2 ranks; odb.BatchShardSampler deals as
Accelerate does in each case, tests/data/test_batch_shard.py). Before odb kept them, following the refusal's
fix (``"random"``) changed every step: the 2.4e-1 above.
"""

from __future__ import annotations

import logging

import pytest
import torch

import schedule_workers as S
from dist_harness import run_ranks

GAP = 1e-5
N = 250  # batches of 4 x 2 accumulated: 31 steps of 8 and one of 2 per epoch on 1 rank
GROUPED = {"train_sampling_strategy": "group_by_length"}
REBALANCE = {"train_sampling_strategy": "batch_rebalance"}
# T5's loss does not read num_items_in_batch, so the plain Seq2SeqTrainer's accumulated micro-batches are no token
# mean (its update is twice odb's exact one at 2 micro-batches: gap 0.48): one batch of 8 per step there.
TRAINERS = {"seq2seq": dict(batch=8, ga=1), "sft": dict(budget=120)}


def check(plain: dict, odb: dict, what: str) -> float:
    assert S.same_start(plain, odb)
    assert odb["global_step"] == plain["global_step"] and odb["rates"] == plain["rates"], what
    assert max(odb["micro"]) > 2, f"{what}: odb did not cut the steps into micro-batches of its own"
    gap = S.update_gap(plain, odb)
    print(f"{what}: {plain['global_step']} steps, relative update gap {gap:.2e}")
    assert gap <= GAP, f"{what}: relative update gap {gap:.2e}"
    assert torch.equal(odb["rng"], plain["rng"]), f"{what}: torch's global RNG is not where the Trainer left it"
    return gap


def test_group_by_length_keeps_the_trainers_steps_on_one_process(tmp_path):
    p = dict(n=N, args=GROUPED)
    plain = S.run(0, 1, dict(p, out=str(tmp_path / "plain")))
    assert plain["global_step"] == 2 * 32
    for name, extra in {"padded": {}, "packed": dict(packed=True), "lengths given": dict(known=True)}.items():
        odb = S.run(0, 1, dict(p, odb=True, out=str(tmp_path / name), **extra))
        check(plain, odb, f"group_by_length, 1 process, {name}")


def test_a_resume_in_the_middle_of_an_epoch_reads_on_in_the_same_order(tmp_path):
    # the checkpoint at step 40 is in the second epoch (32 steps each); its order is drawn again from the RNG
    # state saved with it (without that, the resumed run redraws from the restored RNG: gap 3.1e-2)
    p = dict(n=N, args=dict(GROUPED, save_strategy="steps", save_steps=20))
    plain = S.run(0, 1, dict(p, out=str(tmp_path / "plain")))
    S.run(0, 1, dict(p, odb=True, out=str(tmp_path / "odb")))
    resumed = S.run(0, 1, dict(p, odb=True, out=str(tmp_path / "resumed"),
                               resume=str(tmp_path / "odb" / "checkpoint-40")))
    assert resumed["rates"] == plain["rates"][40:]
    resumed["before"] = plain["before"]  # the whole run's update, resumed at step 40 of 64
    gap = S.update_gap(plain, resumed)
    print(f"group_by_length, resumed at step 40 of 64: relative update gap {gap:.2e}")
    assert gap <= GAP and torch.equal(resumed["rng"], plain["rng"])


def test_a_resume_on_another_number_of_ranks_is_refused_with_the_fix():
    import odb
    from odb.integrations.hf.sampling import replay_order

    class Loader:
        sampler = odb.BatchShardSampler(range(8), batch_size=2, num_replicas=1, rank=0)

    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\) in the middle of an epoch.*cannot resume that epoch "
                                         r"on 1.*Fix: resume on 2 rank\(s\), or pass ignore_data_skip=True"):
        replay_order(Loader(), {"world_size": 2}, "ckpt", 1)


def test_batch_rebalance_keeps_its_steps_and_says_so_once(tmp_path, caplog):
    p = dict(n=N, args=REBALANCE)
    plain = S.run(0, 1, dict(p, out=str(tmp_path / "plain")))
    with caplog.at_level(logging.WARNING, logger="odb.integrations.hf.sampling"):
        odb = S.run(0, 1, dict(p, odb=True, out=str(tmp_path / "odb")))
    said = [r.getMessage() for r in caplog.records if "batch_rebalance" in r.getMessage()]
    assert len(said) == 1 and "keeps BatchRebalanceSampler's optimizer steps" in said[0] and \
        "global plan" in said[0], said
    check(plain, odb, "batch_rebalance, 1 process")


@pytest.mark.parametrize("trainer", ["seq2seq", pytest.param("sft", marks=pytest.mark.trl)])
def test_group_by_length_in_seq2seq_and_trl_sft_trainers(tmp_path, trainer):
    p = dict(n=60, trainer=trainer, args=GROUPED, **TRAINERS[trainer])
    plain = S.run(0, 1, dict(p, out=str(tmp_path / "plain")))
    odb = S.run(0, 1, dict(p, odb=True, out=str(tmp_path / "odb")))
    check(plain, odb, f"group_by_length, {trainer}")


# Each case: the plain Trainer's arguments and odb's runs against it. 2 ranks: 63 batches, so the last round has
# one batch and a partial one (even_batches fills both). 3 ranks: 21 batches each, the last partial. Accelerate's
# even_batches=False deals as odb.BatchShardSampler's default does (tests/data/test_batch_shard.py).
CASES = {2: {"default": (GROUPED, ["padded", "packed"])},
         3: {"default": (GROUPED, ["padded", "packed"]),
             "drop_last": (dict(GROUPED, dataloader_drop_last=True), ["padded"])},
         "batch_rebalance": {"batch_rebalance": (REBALANCE, ["padded"])}}


def accelerate_shards_a_batch_sampler_without_batch_size() -> bool:
    """Whether accelerate's prepare takes a batch sampler without ``batch_size`` (BatchRebalanceSampler) with its
    default even_batches: older releases (1.3) raise, so the plain Trainer cannot run batch_rebalance on 2 ranks."""
    from accelerate.data_loader import BatchSamplerShard

    try:
        BatchSamplerShard([[0], [1]], num_processes=2, process_index=0)  # a list has no batch_size
    except ValueError:
        return False
    return True


def run_cases(tmp_path, world, cases):
    runs, pairs = [], []
    for name, (args, layouts) in cases.items():
        plain = len(runs)
        runs.append(dict(n=N, args=args))
        for layout in layouts:
            pairs.append((f"{name}, {layout}", plain, len(runs)))
            runs.append(dict(n=N, args=args, odb=True, packed=layout == "packed"))
    ranks = run_ranks("schedule_workers:suite", world, {"runs": runs, "out": str(tmp_path / "out")}, tmp_path / "h",
                      deadline_s=300)
    for rank, results in enumerate(ranks):
        for what, plain, odb in pairs:
            check(results[plain], results[odb], f"{world} ranks, rank {rank}, {what}")


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 3])
def test_the_trainers_steps_across_ranks(tmp_path, world):
    run_cases(tmp_path, world, CASES[world])


@pytest.mark.dist
def test_batch_rebalance_keeps_the_trainers_steps_on_two_ranks(tmp_path):
    if not accelerate_shards_a_batch_sampler_without_batch_size():
        pytest.skip("this accelerate's prepare refuses a batch sampler without batch_size (BatchRebalanceSampler) "
                    "on several processes, so the plain Trainer it is compared with cannot run")
    run_cases(tmp_path, 2, CASES["batch_rebalance"])


@pytest.mark.dist
def test_accelerate_settings_that_deal_the_steps_otherwise_are_refused_on_several_ranks(tmp_path):
    settings = [{"split_batches": True}, {"dispatch_batches": True}, {"use_seedable_sampler": False}]
    args = [dict(GROUPED, accelerator_config=c) for c in settings] + [
        dict(REBALANCE, accelerator_config={"use_seedable_sampler": False}), GROUPED]
    got = run_ranks("schedule_workers:refusals", 2, {"args": args, "out": str(tmp_path / "out")}, tmp_path / "h")
    for messages in got:
        for setting, message in zip(["split_batches=True", "dispatch_batches=True", "use_seedable_sampler=False"],
                                    messages):
            assert f"on 2 processes with Accelerate's {setting}" in message and "Fix: leave them at their " \
                "defaults" in message, message
        assert messages[3:] == ["", ""]  # batch_rebalance draws from its own seed; the defaults are kept

