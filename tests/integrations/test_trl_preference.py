"""odb in TRL's real DPOTrainer and RewardTrainer (the pinned TRL, CPU): a pair is one sample budgeted as the two
rows it collates to, each micro-batch's mean per pair is weighted by its share of the step's pairs, and one
forward runs per micro-batch. The reference is TRL's own trainer without odb, one optimizer step over exactly
the same pairs (tests/support/trl_workers.py: float64 tiny Llamas from configs, the offline tokenizer).

Before: both trainers were refused; before that they trained silently wrong (token weights where TRL averages
per pair, micro-batches up to twice the budget, and an extra forward per DPO micro-batch).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import datasets  # noqa: F401  (pinned under `make test`, as trl is: a broken install fails, never skips)
import trl  # noqa: F401  (the pinned TRL: a broken install fails, never skips)
import trl_workers as W
from dist_harness import run_ranks

from odb import ODBConfig
from odb.integrations.hf import enable_odb
from odb.integrations.trl.pairs import PairLength, PairUnits

pytestmark = pytest.mark.trl

# DPO's fused LM head (TRL) computes part of the log-probabilities in float32; the reward model runs in float64
# throughout (sdpa attention), so its step matches to rounding.
EXACT = {"dpo": 1e-6, "reward": 1e-12}


def rel_error(delta: dict, ref: dict) -> float:
    scale = max(r.abs().max().item() for r in ref.values())
    return max((delta[n] - r).abs().max().item() for n, r in ref.items()) / scale


def params(trainer: str, **kw) -> dict:
    p = dict(trainer=trainer, n=24, ga=2, per_device=4, budget=48, lr=1e-2)
    p.update(kw)
    return p


def check_run(r: dict, p: dict, step_pairs: int, world: int = 1) -> None:
    """The run's last step: its pairs weighted per pair, its batches within the budget, one forward each."""
    infos = r["infos"]
    assert r["loss_scaling"] == "sample" and r["global_step"] == 1
    assert [i["micro_step"] for i in infos] == list(range(len(infos)))
    for i in infos:  # each micro-batch's mean per pair weighted by its share of the step's pairs (x world: DDP)
        assert math.isclose(i["loss_scale"], 0.0 if i["is_ghost"] else world * i["local_samples"] / step_pairs)
    for pairs, (rows, width) in r["shapes"]:  # every collated batch: 2 rows per pair, rows x longest row <= budget
        assert rows == 2 * pairs and rows * width <= p["budget"], (pairs, rows, width)
    assert r["forwards"] == len(infos)  # one forward per micro-batch (TRL's reference model is another module)


# ---- odb's cost of a pair is the batch TRL's collator builds -------------------------------------------


@pytest.mark.parametrize("trainer,max_length,pad", [("dpo", None, None), ("dpo", 7, None), ("dpo", 9, 4),
                                                    ("reward", None, None), ("reward", None, 8)])
def test_pair_length_is_what_the_collator_builds(trainer, max_length, pad):
    from trl.trainer import dpo_trainer, reward_trainer

    if trainer == "dpo":
        collate = dpo_trainer.DataCollatorForPreference(pad_token_id=0, max_length=max_length, pad_to_multiple_of=pad)
        fields, length = ("prompt_ids", "chosen_ids", "rejected_ids"), PairLength("prompt_ids", max_length)
    else:
        collate = reward_trainer.DataCollatorForPreference(pad_token_id=0, pad_to_multiple_of=pad)
        fields, length = ("chosen_ids", "rejected_ids"), PairLength(None, None)
    multiple = 2 * (pad or 1)  # odb's pad_to_multiple_of for pairs: twice the collator's
    g = torch.Generator().manual_seed(0)
    for _ in range(30):
        pairs = [{k: torch.randint(1, 40, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
                  for k in fields} for _ in range(int(torch.randint(1, 6, (1,), generator=g)))]
        batch = collate(pairs)["input_ids"]
        odb_cost = len(pairs) * (-(-max(length(s) for s in pairs) // multiple) * multiple)  # B x padded 2L
        assert batch.shape[0] == 2 * len(pairs) and batch.numel() == odb_cost, (pairs, batch.shape)


# ---- the optimizer step equals TRL's without odb ---------------------------------------------------------


@pytest.mark.parametrize("trainer", ["dpo", "reward"])
def test_one_step_equals_trl_without_odb(tmp_path, trainer):
    p = params(trainer, out=str(tmp_path / "run"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = W.pair_ranks(0, 1, p)
    assert not [w for w in caught if "return_outputs" in str(w.message)]  # DPO's extra forward is never asked for
    assert len(r["ids"]) == len(set(r["ids"])) == 8  # per_device_train_batch_size x gradient_accumulation_steps
    pairs = [i["local_samples"] for i in r["infos"]]
    assert len(pairs) >= 3 and len(set(pairs)) > 1  # unequal micro-batches: token or batch weights would differ
    check_run(r, p, 8)
    ref = W.pair_reference(p, r["ids"], str(tmp_path / "ref"))
    assert rel_error(r["delta"], ref) < EXACT[trainer]


@pytest.mark.dist
def test_two_processes_equal_trl_without_odb(tmp_path):
    runs = [params("dpo", ga=2, per_device=3), params("reward", ga=1, per_device=4, budget=56)]
    ranks = run_ranks("trl_workers:pair_suite", 2, {"runs": runs, "out": str(tmp_path / "runs")}, tmp_path / "h",
                      deadline_s=280)
    for k, p in enumerate(runs):
        step_pairs = p["per_device"] * p["ga"] * 2
        ids = sorted(i for r in ranks for i in r[k]["ids"])
        assert len(ids) == len(set(ids)) == step_pairs
        ref = W.pair_reference(p, ids, str(tmp_path / f"ref{k}"))
        for rank, r in enumerate(ranks):
            check_run(r[k], p, step_pairs, world=2)
            assert rel_error(r[k]["delta"], ref) < EXACT[p["trainer"]], f"rank {rank}, run {p}"
        assert len(ranks[0][k]["infos"]) == len(ranks[1][k]["infos"])  # the ranks' micro-batches aligned


# ---- what enable_odb sets, and what it refuses with the fix ----------------------------------------------


def build(tmp_path, trainer="dpo", **args):
    return W.pair_trainer(dict(trainer=trainer, n=8, args=args), str(tmp_path))


def test_collator_settings_become_odb_options(tmp_path):
    dpo = enable_odb(build(tmp_path, "dpo", pad_to_multiple_of=8, max_length=12, padding_free=True), token_budget=256)
    cfg = dpo.odb_config
    assert cfg.loss_scaling == "sample" and isinstance(cfg.loss_tokens_fn, PairUnits)
    assert repr(cfg.length_fn) == repr(PairLength("prompt_ids", 12)) and cfg.pad_to_multiple_of == 16
    assert cfg.layout == "padded"  # TRL 1.x turns DPOConfig(padding_free=True) off: its batches stay padded
    reward = enable_odb(build(tmp_path, "reward"), token_budget=256, quadratic_length=64)
    cfg = reward.odb_config
    assert repr(cfg.length_fn) == repr(PairLength(None, None)) and cfg.pad_to_multiple_of == 1
    assert cfg.quadratic_length == 128  # per token of B x 2L: 1 + 2L / 128 = 1 + L / 64 per token of 2B x L
    assert enable_odb(build(tmp_path, "dpo"), config=ODBConfig(token_budget=256)).odb_config.loss_scaling == "sample"


def _own_collator(samples):
    return samples


@pytest.mark.parametrize("trainer,args,odb,words", [
    ("dpo", {}, {"loss_scaling": "exact"}, ["loss_scaling='exact'", "averages its loss over the pairs",
                                           "Fix: leave loss_scaling out"]),
    ("reward", {}, {"config": ODBConfig(token_budget=256, loss_scaling="approx")},
     ["RewardTrainer with loss_scaling='approx'", "Fix: leave loss_scaling out"]),
    ("dpo", {}, {"length_fn": len}, ["length_fn=<built-in function len>", "two rows", "Fix: leave length_fn out"]),
    ("reward", {}, {"loss_tokens_fn": len}, ["loss_tokens_fn=", "mean per pair", "Fix: leave loss_tokens_fn out"]),
    ("dpo", {}, {"lengths": [10] * 8}, ["lengths=<8 values>", "twice token_budget", "Fix: leave lengths out"]),
    ("dpo", {}, {"layout": "packed"}, ["layout='packed'", "TRL pads preference pairs", "Fix: leave layout out"]),
    ("reward", {}, {"pad_to_multiple_of": 4}, ["pad_to_multiple_of=4", "RewardConfig",
                                               "Fix: leave pad_to_multiple_of out"]),
    ("dpo", {}, {"shape_buckets": (64, 128, 256)}, ["shape_buckets=(64, 128, 256)", "Fix: leave shape_buckets out"]),
    ("dpo", {}, {"token_budget": "auto"}, ["token_budget='auto'", "Fix: pass one int token_budget"]),
    ("dpo", {"loss_type": ["aot"]}, {}, ["loss_type='aot'", "sorts the log-ratios", "Fix: use a per-pair loss_type"]),
    ("dpo", {"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 1.0]}, {},
     ["loss_type='sft'", "chosen tokens of the batch", "Fix: use a per-pair loss_type"]),
])
def test_contradicting_settings_are_refused_with_the_fix(tmp_path, trainer, args, odb, words):
    built = build(tmp_path, trainer, **args)
    odb = dict(odb)
    budget = odb.pop("token_budget", None if "config" in odb else 256)
    with pytest.raises(ValueError) as info:
        enable_odb(built, budget, **odb)
    text = str(info.value)
    assert text.startswith("odb cannot train this ") and "Rule: " in text, text
    assert all(w in text for w in words), text


def test_another_collator_is_refused(tmp_path):
    trainer = build(tmp_path, "reward")
    trainer.data_collator = _own_collator
    with pytest.raises(ValueError, match=r"RewardTrainer with the data collator _own_collator.*"
                                         r"DataCollatorForPreference.*Fix: leave data_collator out"):
        enable_odb(trainer, token_budget=256)


def test_a_pair_over_the_budget_is_refused_at_enable_odb(tmp_path):
    trainer = build(tmp_path, "dpo")
    length = PairLength("prompt_ids", None)
    longest = max(length(trainer.train_dataset[i]) for i in range(len(trainer.train_dataset)))
    budget = longest - 2  # fits any single row, not the longest pair's two
    with pytest.raises(ValueError, match=rf"collates to two rows of {longest // 2} tokens \({longest} in odb's cost"
                                         rf".*token_budget={budget}.*Fix: raise token_budget to at least {longest}, "
                                         rf"build the trainer with max_length={budget // 2} or less in the DPOConfig"):
        enable_odb(trainer, token_budget=budget)
    enable_odb(build(tmp_path, "dpo"), token_budget=longest)  # the longest pair alone fits: accepted
    enable_odb(build(tmp_path, "dpo"), token_budget=budget, oversize="alone")
