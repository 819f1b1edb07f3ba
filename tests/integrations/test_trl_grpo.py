"""TRL's GRPOTrainer and RLOOTrainer with odb cutting the policy update by tokens
(odb.integrations.trl.rl): every optimizer step's gradient is TRL's own, for every loss_type, and so is
every metric TRL logs.

Each case trains TRL alone, then TRL with odb, in one process from one seed: the two arms
sample the same rollouts (tests/support/trl_rl_workers.py), each optimizer step's gradient
is recorded before the optimizer uses it, and TRL logs every step. On two processes rows move between the
ranks (step_plan="global"), for every loss_type: each rank's loss is then that of the rows it trained, each
row weighted by its own slice's normaliser, and the sum over ranks is TRL's. Tolerance: TRL computes
log-probabilities with its own fused LM head in float32 whatever the model's dtype, so trimming a
micro-batch's padding changes their rounding at float32 level (about 1e-7 relative); a wrong normaliser or a
lost token changes the gradient by orders of magnitude more. The logged metrics (the loss, grad_norm, kl,
entropy, clip ratios, policy_loss, ...) are compared key by key, step by step, within 1e-6 relative.
"""

from __future__ import annotations

import numpy as np
import pytest

import datasets  # noqa: F401  (pinned under `make test`, as trl is: a broken install fails, never skips)
import trl
import trl_rl_workers as R
from dist_harness import run_ranks

from odb.integrations import hf as odb_hf
from odb.integrations import trl as odb_trl
from odb.integrations.trl.rl import enable_odb_rl

pytestmark = pytest.mark.trl

EXACT = 1e-5  # float32 log-probabilities inside TRL (see the module docstring)
BUDGET = 40   # padded tokens: TRL's slices here are 4 rows x up to 22 tokens, so most are cut in two or more


def rel_gap(ref, got) -> float:
    worst = 0.0
    for g_ref, g_got in zip(ref, got):
        scale = max(float(x.abs().max()) for x in g_ref)
        assert scale > 0, "an optimizer step without gradient proves nothing"
        worst = max(worst, max(float((x - y).abs().max()) for x, y in zip(g_ref, g_got)) / scale)
    return worst


METRICS = 1e-6  # relative, every key TRL logs (the goal)...
# ...above the float32 rounding of values that cancel. The loss (and policy_loss) at a generation's first
# iteration is minus the mean of advantages centred in each group times importance ratios that are 1 up to the
# rounding of the log-probabilities (RLOO: of sums of ~10 per-token log-probabilities near -4), so it is 0 up to
# about 1e-6; kl at the first step, against a reference equal to the policy, is 0 up to about 1e-12.
CANCELLED = {"loss": 2e-6, "train_loss": 2e-6, "policy_loss": 2e-6}
ROUNDING = 1e-9
TIMING = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def check_logs(ref, odb, what) -> None:
    """TRL's log of every step with odb equals TRL's without it, key by key (odb adds its own odb_* keys)."""
    assert len(ref["logs"]) == len(odb["logs"]) >= 3, what
    compared = 0
    for step, (want, got) in enumerate(zip(ref["logs"], odb["logs"])):
        assert set(want) <= set(got) and all(k.startswith("odb_") for k in set(got) - set(want)), (what, step)
        for key, a in want.items():
            if key in TIMING:
                continue
            b = got[key]
            if isinstance(a, float) and isinstance(b, float) and (a != a or b != b):
                assert a != a and b != b, (what, step, key, a, b)  # NaN on both sides
                continue
            assert abs(a - b) <= METRICS * max(abs(a), abs(b)) + CANCELLED.get(key, ROUNDING), (what, step, key, a, b)
            compared += 1
    assert compared > 20, what


def check_pair(ref, odb, what, own_rows=True) -> None:
    """odb's arm against TRL's: the same gradients and losses, micro-batches within the budget; ``own_rows``: this
    rank trained its own rows (moved rows make a rank's loss and padded tokens the sum's business: the test of moved
    rows sums them over ranks)."""
    assert len(odb["grads"]) == len(ref["grads"]) >= 2, what
    assert rel_gap(ref["grads"], odb["grads"]) < EXACT, what
    check_logs(ref, odb, what)
    for a, b in zip(ref["losses"], odb["losses"] if own_rows else ref["losses"]):  # the loss is TRL's too
        assert abs(a - b) <= EXACT * max(1.0, abs(a)), what
    assert odb["micro_steps"] > odb["slices"] > 0, f"odb cut nothing: {what}"
    for rows, prompt, completion, tokens in odb["micro_batches"]:
        # within the budget, and never more than TRL's layout of the same rows (its longest prompt + completion)
        assert tokens <= odb["budget"] and tokens <= rows * (prompt + completion), (rows, prompt, completion, what)
    assert odb["slice_tokens"] == ref["slice_tokens"]  # the same slices were handed to the loss...
    assert odb["padded"] < ref["slice_tokens"] or not own_rows, what   # ...and odb trained on fewer padded tokens
    if "packed" in what:  # packed rows: the model ran the rollouts' tokens and nothing else
        assert odb["padded"] == odb["real"], what
    else:
        assert odb["padded"] >= odb["real"], what


CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "cispo": dict(loss_type="cispo"),
    "sapo": dict(loss_type="sapo"),
    "luspo": dict(loss_type="luspo", args={"importance_sampling_level": "sequence"}),
    "vespo": dict(loss_type="vespo"),
    "rloo": dict(trainer="rloo"),
    # the KL to a reference model and the entropy bonus (its own per-token normaliser)
    "grpo_kl_entropy": dict(loss_type="grpo", beta=0.1, args={"entropy_coef": 0.5}),
    "bnpo_kl_entropy": dict(loss_type="bnpo", beta=0.1, args={"entropy_coef": 0.5}),
    # num_iterations=2: the generation batch trained twice, with TRL's old log-probabilities and clipped ratios
    "dapo_iterations": dict(loss_type="dapo", num_iterations=2),
    "rloo_kl_iterations": dict(trainer="rloo", beta=0.1, num_iterations=2, max_steps=3),
    # steps_per_generation=4 with 2 accumulation steps: one generation spans two optimizer steps
    "grpo_steps_per_generation": dict(loss_type="grpo", steps_per_generation=4, max_steps=3),
    # packed rows (one row of rollouts per micro-batch, odb's per-sample attention): the same gradients
    "grpo_packed": dict(loss_type="grpo", layout="packed"),
    "bnpo_kl_entropy_packed": dict(loss_type="bnpo", beta=0.1, args={"entropy_coef": 0.5}, layout="packed"),
    "dapo_iterations_packed": dict(loss_type="dapo", num_iterations=2, layout="packed"),
    "dr_grpo_packed": dict(loss_type="dr_grpo", layout="packed"),
    "rloo_packed": dict(trainer="rloo", layout="packed"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_gradient_is_trls_for_every_loss_type(tmp_path, case):
    p = dict(CASES[case], budget=BUDGET, out=str(tmp_path))
    got = R.pair_ranks(0, 1, p)
    check_pair(got["ref"], got["odb"], case)
    if "entropy_coef" in p.get("args", {}):  # TRL's coefficient, once per step, and its policy_loss, in the log
        logged = [log["entropy_coef"] for log in got["odb"]["logs"] if "entropy_coef" in log]
        assert logged == [pytest.approx(0.5, rel=1e-12)] * 2
        assert len([log for log in got["odb"]["logs"] if "policy_loss" in log]) == 2
    assert [log["odb_micro_steps"] for log in got["odb"]["logs"] if "odb_micro_steps" in log][0] > 1


def test_rows_may_move_on_one_process_too_and_the_gradient_is_trls(tmp_path):
    # step_plan="global" on one process: the global planner and odb's micro-batch assembly, nothing to move
    got = R.pair_ranks(0, 1, dict(CASES["dapo_iterations"], budget=BUDGET, out=str(tmp_path), step_plan="global"))
    check_pair(got["ref"], got["odb"], "dapo_iterations, step_plan='global', 1 process")
    assert got["odb"]["step_plan"] == "global" and got["odb"]["moved_rows"] == 0
    assert [log["odb_moved_rows"] for log in got["odb"]["logs"] if "odb_moved_rows" in log] == [0.0, 0.0]


@pytest.mark.dist
def test_two_ranks_run_the_same_micro_steps_and_get_trls_gradient(tmp_path):
    # step_plan="rank": rows stay on their rank, the same rows per micro-step on both
    runs = [dict(CASES["grpo_kl_entropy"], budget=BUDGET, step_plan="rank"),
            dict(CASES["dapo_iterations"], budget=BUDGET, step_plan="rank"),
            dict(CASES["grpo_packed"], budget=BUDGET, step_plan="rank")]
    ranks = run_ranks("trl_rl_workers:suite_ranks", 2, {"runs": runs, "out": str(tmp_path / "o")}, tmp_path / "h",
                      deadline_s=280)
    for k, run in enumerate(runs):
        for rank, r in enumerate(ranks):
            check_pair(r[k]["ref"], r[k]["odb"], f"rank {rank}, {run}" + (" packed" if run.get("layout") else ""))
        # One plan for both ranks: the same micro-steps with the same rows each (DDP and TRL's gathers line up),
        # though each rank cuts its own rollouts.
        assert ranks[0][k]["odb"]["plans"] == ranks[1][k]["odb"]["plans"]
        rows = [[m[0] for m in r[k]["odb"]["micro_batches"]] for r in ranks]
        assert rows[0] == rows[1]
        assert ranks[0][k]["odb"]["micro_batches"] != ranks[1][k]["odb"]["micro_batches"], "the ranks had one rollout"
        # DDP averaged the gradient: both ranks hold the same one
        assert rel_gap(ranks[0][k]["odb"]["grads"], ranks[1][k]["odb"]["grads"]) < 1e-12
        assert {r[k]["odb"]["step_plan"] for r in ranks} == {"rank"} and not any(r[k]["odb"]["moves"] for r in ranks)


def mixed_micro_batches(plans, n: int) -> int:
    """Micro-batches of a global plan holding rows of several ranks' slices."""
    return sum(len({row // n for row in group}) > 1 for plan in plans for rank in plan for group in rank)


def check_moved(ranks, k, name) -> None:
    """Rows moved between the two ranks, and each rank's gradient, loss and logs are TRL's as a pair."""
    odb = [r[k]["odb"] for r in ranks]
    for rank, r in enumerate(ranks):
        check_pair(r[k]["ref"], r[k]["odb"], f"rank {rank}, {name}, rows moving", own_rows=False)
    # A rank's loss is that of the rows it trained; the Trainer logs the mean over ranks, which is TRL's.
    for step, want in enumerate(np.sum([r[k]["ref"]["losses"] for r in ranks], axis=0)):
        got = sum(o["losses"][step] for o in odb)
        assert abs(got - want) <= EXACT * max(1.0, abs(want)), (name, step)
    assert sum(o["padded"] for o in odb) < sum(r[k]["ref"]["slice_tokens"] for r in ranks), name
    assert [o["step_plan"] for o in odb] == ["global", "global"], name
    assert odb[0]["plans"] == odb[1]["plans"], name  # one plan, computed by each rank from both ranks' lengths
    # rows moved at some step (each rank counts the rows it received), and both ranks agree on how many
    assert sum(o["moved_rows"] for o in odb) > 0, f"no row moved: {name}"
    assert [m[0] for o in odb for m in o["moves"]] and all(len(o["moves"]) == o["slices"] for o in odb)
    assert rel_gap(odb[0]["grads"], odb[1]["grads"]) < 1e-12, name  # DDP averaged the gradient


# Rows move for every loss: bnpo and the entropy bonus too (each row weighted by its own slice's loss tokens);
# step_plan="auto" takes "global" on two processes.
GLOBAL_RUNS = {"grpo": CASES["grpo"], "dapo_iterations": CASES["dapo_iterations"], "rloo": CASES["rloo"],
               "grpo_packed": CASES["grpo_packed"], "bnpo": dict(loss_type="bnpo", step_plan="auto"),
               "bnpo_kl_entropy_packed": CASES["bnpo_kl_entropy_packed"],
               "grpo_kl_entropy": dict(CASES["grpo_kl_entropy"], num_iterations=2)}


@pytest.mark.dist
def test_two_ranks_move_rows_and_get_trls_gradient(tmp_path):
    # step_plan="global": rows move between the ranks (the eos bias gives rollouts of varied lengths, so the ranks'
    # slices cost differently), each rank's micro-batches hold its own number of rows, the gradient is TRL's.
    runs = [dict(dict(step_plan="global"), **case, budget=BUDGET) for case in GLOBAL_RUNS.values()]
    ranks = run_ranks("trl_rl_workers:suite_ranks", 2, {"runs": runs, "out": str(tmp_path / "o")}, tmp_path / "h",
                      deadline_s=560)
    for k, name in enumerate(GLOBAL_RUNS):
        check_moved(ranks, k, name)
    # bnpo and the entropy bonus trained micro-batches holding rows of both ranks' slices (each row its own weight)
    for k, name in enumerate(GLOBAL_RUNS):
        if "bnpo" in name or "entropy" in name:
            assert mixed_micro_batches(ranks[0][k]["odb"]["plans"], 4) > 0, name


def test_moved_rows_keep_their_values_dtypes_and_shapes():
    import torch

    from odb.integrations.trl.rl_move import micro_batch, pack_rows, unpack_rows

    def slice_(prompt, completion, width_p, width_c):
        n = len(prompt)
        pm = torch.tensor([[0] * (width_p - p) + [1] * p for p in prompt])
        cm = torch.tensor([[1] * c + [0] * (width_c - c) for c in completion])
        return {"prompt_ids": pm * torch.randint(3, 40, pm.shape), "prompt_mask": pm,
                "completion_ids": cm * torch.randint(3, 40, cm.shape), "completion_mask": cm,
                "old_per_token_logps": torch.randn(n, width_c, dtype=torch.float64) * cm,
                "advantages": torch.randn(n), "old_logps": torch.randn(n, dtype=torch.float32),
                "num_items_in_batch": torch.tensor(17)}

    torch.manual_seed(0)
    a, b = slice_([2, 5, 3], [7, 1, 4], 6, 9), slice_([1, 1, 2], [2, 3, 1], 3, 4)
    received = {0: (unpack_rows(pack_rows(a, np.array([0, 2])), b), np.array([0, 2]))}
    piece = micro_batch(b, received, rank=1, n=3, rows=np.array([0, 2, 4]), prompt_width=3, completion_width=7)
    assert piece["prompt_ids"].shape == (3, 3) and piece["completion_ids"].shape == (3, 7)
    assert piece["num_items_in_batch"] is b["num_items_in_batch"]
    for key in ("advantages", "old_logps", "old_per_token_logps"):
        assert piece[key].dtype == a[key].dtype
    want = [(a, 0), (a, 2), (b, 1)]  # flat rows 0 and 2 (rank 0's) then 4 (rank 1's row 1)
    for i, (src, row) in enumerate(want):
        for key in ("prompt_ids", "completion_ids", "old_per_token_logps"):
            real = src[key][row][(src["prompt_mask"] if key == "prompt_ids" else src["completion_mask"])[row].bool()]
            mask = piece["prompt_mask"] if key == "prompt_ids" else piece["completion_mask"]
            assert torch.equal(piece[key][i][mask[i].bool()], real), (key, i)
        assert piece["advantages"][i] == src["advantages"][row] and piece["old_logps"][i] == src["old_logps"][row]
    assert piece["prompt_mask"][:, -1].all() and piece["completion_mask"][:, 0].all()  # left / right padded


def test_a_rollout_alone_over_the_budget_stops_the_step_naming_it(tmp_path):
    # No end-of-sequence at generation: every completion is max_completion_length=12 tokens, which the budget fits;
    # with a prompt of more than 2 tokens it does not.
    trainer = R.build(dict(loss_type="grpo", max_steps=1, eos_bias=-30.0), str(tmp_path), R.GradRecorder())
    odb_trl.enable_odb(trainer, token_budget=14)
    with pytest.raises(ValueError, match=r"rollout row \d+ alone costs \d+ padded tokens .* over token_budget=14"):
        trainer.train()


@pytest.mark.parametrize("p", [dict(loss_type="bnpo"), dict(loss_type="grpo", args={"entropy_coef": 0.5})],
                         ids=["bnpo", "entropy_bonus"])
def test_rows_may_move_under_bnpo_and_the_entropy_bonus(tmp_path, p):
    # Each row carries its own slice's normaliser: step_plan="global" is accepted ("auto" takes it on several
    # processes; tests/integrations/test_trl_grpo.py's two-process runs train it against TRL).
    trainer = R.build(p, str(tmp_path), R.GradRecorder())
    assert odb_trl.enable_odb(trainer, token_budget=BUDGET, step_plan="global").odb_rl.step_plan == "global"


REFUSED = [
    (dict(args={"top_entropy_quantile": 0.5}), "top_entropy_quantile=0.5"),
    (dict(args={"use_adaptive_entropy": True, "entropy_coef": 0.01}), "use_adaptive_entropy=True"),
]


@pytest.mark.parametrize("p,words", REFUSED, ids=["entropy_quantile", "adaptive_entropy"])
def test_settings_odb_cannot_cut_exactly_are_refused_before_anything_changes(tmp_path, p, words):
    trainer = R.build(dict(p, loss_type="grpo"), str(tmp_path), R.GradRecorder())
    with pytest.raises(ValueError) as refused:
        odb_trl.enable_odb(trainer, token_budget=BUDGET)
    text = str(refused.value)
    assert text.startswith("odb cannot cut GRPOTrainer's policy update exactly with " + words) and "Fix: " in text
    assert "compute_loss" not in vars(trainer) and not hasattr(trainer, "odb_rl")


def test_a_vision_language_trainer_is_refused_at_the_call(tmp_path):
    trainer = R.build(dict(loss_type="grpo"), str(tmp_path), R.GradRecorder())
    trainer._is_vlm = True  # what GRPOTrainer sets for a ProcessorMixin processing_class (no VLM hub download here)
    with pytest.raises(ValueError, match="with a vision-language model .* Fix: train this vision-language model "
                                         "without odb's micro-batches"):
        odb_trl.enable_odb(trainer, token_budget=BUDGET)
    assert not hasattr(trainer, "odb_rl")


def test_a_subclass_with_its_own_loss_is_refused(tmp_path):
    trainer = R.build(dict(loss_type="grpo"), str(tmp_path), R.GradRecorder())

    class MyGRPO(trl.GRPOTrainer):
        def _compute_loss(self, model, inputs):
            return super()._compute_loss(model, inputs) * 2

    trainer.__class__ = MyGRPO
    with pytest.raises(ValueError, match="_compute_loss overridden by .*MyGRPO"):
        enable_odb_rl(trainer, token_budget=BUDGET)


@pytest.mark.parametrize("call,words", [
    (lambda t: odb_trl.enable_odb(t, token_budget=12), "token_budget=12 for GRPOTrainer with max_completion_length=12"),
    (lambda t: odb_trl.enable_odb(t, token_budget=True), "token_budget=True"),
    (lambda t: odb_trl.enable_odb(t, token_budget=BUDGET, buffer_size=8), "got ['buffer_size'] for GRPOTrainer"),
    (lambda t: odb_trl.enable_odb(odb_trl.enable_odb(t, token_budget=BUDGET), token_budget=BUDGET),
     "already enabled"),
    # the HF door is odb.enable_odb too: it takes GRPO down the same path, with the same refusals
    (lambda t: odb_hf.enable_odb(t, token_budget=BUDGET, buffer_size=8), "got ['buffer_size'] for GRPOTrainer"),
    (lambda t: odb_trl.enable_odb(t, token_budget=BUDGET, layout="rows"), "layout='rows' for GRPOTrainer"),
    (lambda t: odb_trl.enable_odb(t, token_budget=BUDGET, step_plan="ranks"), "step_plan='ranks' for GRPOTrainer"),
], ids=["budget_below_a_completion", "bool_budget", "loader_options", "twice", "hf_enable_odb", "layout",
        "step_plan"])
def test_wrong_calls_name_the_value_and_the_fix(tmp_path, call, words):
    trainer = R.build(dict(loss_type="grpo"), str(tmp_path), R.GradRecorder())
    with pytest.raises((TypeError, ValueError)) as refused:
        call(trainer)
    assert words in str(refused.value) and "Fix: " in str(refused.value)


@pytest.mark.parametrize("kind", ["grpo", "rloo"])
def test_the_loader_path_refuses_and_names_odbs_rl_path(tmp_path, kind):
    from odb.integrations.hf.trainer import enable_odb as loader_path  # what ODBTrainerMixin runs

    trainer = R.build(dict(trainer=kind), str(tmp_path), R.GradRecorder())
    name = type(trainer).__name__
    loader = trainer.get_train_dataloader
    with pytest.raises(TypeError) as refused:
        loader_path(trainer, token_budget=BUDGET)  # odb's loader would replace TRL's RepeatSampler
    text = str(refused.value)
    assert f"odb cannot train TRL's {name} exactly" in text and "RepeatSampler" in text
    assert "Fix: call odb.enable_odb(trainer, token_budget=...)" in text
    assert trainer.get_train_dataloader.__func__ is loader.__func__ and not hasattr(trainer, "odb_rl")
    # every door (odb.enable_odb, odb.integrations.hf.enable_odb, odb.integrations.trl.enable_odb) takes odb's RL path
    assert odb_hf.enable_odb(trainer, token_budget=BUDGET) is trainer and trainer.odb_rl.name == name
    assert trainer.get_train_dataloader.__func__ is loader.__func__  # TRL's sampler and loader stay TRL's
