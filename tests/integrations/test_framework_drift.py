"""A transformers or TRL release that renames or reshapes a name odb relies on stops odb loudly (``FrameworkDrift``:
the installed version, the missing piece, the fix), never lets it train wrong.

Every name of ``odb.private_api`` (the transformers Trainer's loop methods odb overrides or calls,
TRL's methods odb reads or stands in for, TRL's private flags, and the public TRL settings odb decides by) is
renamed in turn, here, on the real classes and trainers (monkeypatch: restored after each test), and
``enable_odb`` refuses. A stand-in that TRL no longer calls (TRL's loss reaching its own forward another way)
and a metric odb cannot recombine stop the first step.
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

import trl
import transformers
import hf_workers as H
import trl_rl_workers as R

from odb.integrations import hf as odb_hf
from odb.integrations import trl as odb_trl
from odb.private_api import NAMES, TESTED, TRL_SETTINGS, FrameworkDrift

pytestmark = pytest.mark.trl

BUDGET = 40
CLASSES = {"Trainer": transformers.Trainer, "GRPOTrainer": trl.GRPOTrainer, "RLOOTrainer": trl.RLOOTrainer}


def hf_trainer(tmp_path):
    args = transformers.TrainingArguments(str(tmp_path), use_cpu=True, report_to="none", max_steps=1)
    return transformers.Trainer(model=H.llama(0), args=args, train_dataset=H.causal_dataset(8),
                                data_collator=H.pad_collate)


@pytest.fixture(scope="module")
def rl_trainers(tmp_path_factory):
    """One GRPOTrainer (with the entropy bonus) and one RLOOTrainer; each test renames on them and restores."""
    out = tmp_path_factory.mktemp("drift")
    return {"GRPOTrainer": R.build(dict(loss_type="grpo", args={"entropy_coef": 0.1}), str(out / "g"),
                                   R.GradRecorder()),
            "RLOOTrainer": R.build(dict(trainer="rloo"), str(out / "r"), R.GradRecorder())}


def check_refusal(refused, framework, name) -> None:
    text = str(refused.value)
    version = transformers.__version__ if framework == "transformers" else trl.__version__
    assert f"the installed {framework} {version}" in text and name in text, text
    assert f"Fix: pin the tested range (pip install '{TESTED[framework]}')" in text, text


def enable(owner, tmp_path, rl_trainers):
    if owner == "Trainer":
        return odb_hf.enable_odb(hf_trainer(tmp_path), token_budget=256)
    trainer = rl_trainers[owner]
    assert not hasattr(trainer, "odb_rl")
    return odb_trl.enable_odb(trainer, token_budget=BUDGET)


METHODS = [n for n in NAMES if n.kind == "method"]
ATTRIBUTES = [n for n in NAMES if n.kind == "attribute"]
SETTINGS = [(owner, name) for owner, names in TRL_SETTINGS.items() for name in names]


@pytest.mark.parametrize("entry", METHODS, ids=[f"{n.owner}.{n.name}" for n in METHODS])
def test_a_renamed_method_is_refused_at_enable_odb(monkeypatch, tmp_path, rl_trainers, entry):
    cls = CLASSES[entry.owner]
    monkeypatch.setattr(cls, entry.name + "_v2", cls.__dict__[entry.name], raising=False)
    monkeypatch.delattr(cls, entry.name)
    with pytest.raises(FrameworkDrift) as refused:
        enable(entry.owner, tmp_path, rl_trainers)
    check_refusal(refused, entry.framework, f"{entry.owner}.{entry.name}")
    assert "has no" in str(refused.value)


@pytest.mark.parametrize("entry", [n for n in METHODS if n.params], ids=[f"{n.owner}.{n.name}" for n in METHODS
                                                                         if n.params])
def test_a_method_without_a_parameter_odb_passes_is_refused(monkeypatch, tmp_path, rl_trainers, entry):
    cls = CLASSES[entry.owner]
    dropped = entry.params[-1]

    def reshaped(self, *args, **kwargs):  # the same method, one of odb's parameters renamed
        raise AssertionError("never called")

    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    reshaped.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(p if p != dropped else dropped + "_v2", kind) for p in ("self",) + entry.params])
    monkeypatch.setattr(cls, entry.name, reshaped)
    with pytest.raises(FrameworkDrift) as refused:
        enable(entry.owner, tmp_path, rl_trainers)
    check_refusal(refused, entry.framework, f"{entry.owner}.{entry.name}")
    assert f"without ['{dropped}']" in str(refused.value)


@pytest.mark.parametrize("entry", ATTRIBUTES, ids=[f"{n.owner}.{n.name}" for n in ATTRIBUTES])
def test_a_renamed_private_flag_is_refused_at_enable_odb(monkeypatch, tmp_path, rl_trainers, entry):
    # Before: getattr(trainer, "_is_vlm", False) and getattr(trainer, "_entropy_bonus_enabled", False) read a
    # renamed flag as False (a vision-language rollout cut by rows; rows moved under the bonus's old rule).
    trainer = rl_trainers[entry.owner]
    monkeypatch.setitem(vars(trainer), entry.name + "_v2", vars(trainer)[entry.name])
    monkeypatch.delitem(vars(trainer), entry.name)
    with pytest.raises(FrameworkDrift) as refused:
        enable(entry.owner, tmp_path, rl_trainers)
    check_refusal(refused, "trl", f"{entry.owner}.{entry.name}")


@pytest.mark.parametrize("owner,name", SETTINGS, ids=[f"{o}.{n}" for o, n in SETTINGS])
def test_a_renamed_setting_is_refused_at_enable_odb(monkeypatch, tmp_path, rl_trainers, owner, name):
    trainer = rl_trainers[owner]
    monkeypatch.setitem(vars(trainer), name + "_v2", vars(trainer)[name])
    monkeypatch.delitem(vars(trainer), name)
    with pytest.raises(FrameworkDrift) as refused:
        enable(owner, tmp_path, rl_trainers)
    check_refusal(refused, "trl", f"{owner}.{name}")


def test_a_flag_of_another_type_is_refused(monkeypatch, tmp_path, rl_trainers):
    monkeypatch.setitem(vars(rl_trainers["GRPOTrainer"]), "_metrics", [])
    with pytest.raises(FrameworkDrift, match=r"sets GRPOTrainer._metrics to a list .* not a dict"):
        enable("GRPOTrainer", tmp_path, rl_trainers)


def test_the_names_pass_on_the_tested_versions(tmp_path, rl_trainers):
    # ...so each refusal above comes from its rename alone
    assert enable("Trainer", tmp_path, rl_trainers) is not None
    for owner in ("GRPOTrainer", "RLOOTrainer"):
        trainer = R.build(dict(loss_type="grpo") if owner == "GRPOTrainer" else dict(trainer="rloo"),
                          str(tmp_path / owner), R.GradRecorder())
        assert odb_trl.enable_odb(trainer, token_budget=BUDGET).odb_rl.name == owner


def test_a_stand_in_trl_no_longer_calls_stops_the_first_step(monkeypatch, tmp_path):
    # TRL's loss reaching its forward under another name: odb's stand-in would go unused and TRL's own forward
    # would run on odb's micro-batch (with layout="packed", on a model switched to odb's attention).
    own = trl.GRPOTrainer._compute_loss

    def renamed_call(self, model, inputs):
        stand_in = vars(self).pop("_get_per_token_logps_and_entropies", None)
        try:
            return own(self, model, inputs)
        finally:
            if stand_in is not None:
                vars(self)["_get_per_token_logps_and_entropies"] = stand_in

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", renamed_call)
    trainer = odb_trl.enable_odb(R.build(dict(loss_type="grpo", max_steps=1), str(tmp_path), R.GradRecorder()),
                                 token_budget=BUDGET)
    with pytest.raises(FrameworkDrift) as refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    check_refusal(refused, "trl", "GRPOTrainer._get_per_token_logps_and_entropies")
    assert "never called GRPOTrainer._get_per_token_logps_and_entropies" in str(refused.value)


def test_a_metric_odb_cannot_recombine_stops_the_first_step(monkeypatch, tmp_path):
    own = trl.GRPOTrainer._compute_loss

    def new_metric(self, model, inputs):
        self._metrics["train"]["clip_ratio/new"].append(0.5)
        return own(self, model, inputs)

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", new_metric)
    trainer = odb_trl.enable_odb(R.build(dict(loss_type="grpo", max_steps=1), str(tmp_path), R.GradRecorder()),
                                 token_budget=BUDGET)
    with pytest.raises(FrameworkDrift) as refused, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    check_refusal(refused, "trl", "'clip_ratio/new'")


def test_the_trl_extra_declares_the_tested_range_only():
    import tomllib
    from pathlib import Path

    extras = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    trl_pins = [r for r in extras["project"]["optional-dependencies"]["trl"] if r.startswith("trl")]
    assert trl_pins == [TESTED["trl"]]


def test_a_stand_in_trl_calls_twice_stops_the_first_step(monkeypatch, tmp_path):
    # odb weighs each row's gradient in the one forward of a loss call: a second forward would go unweighted
    own = trl.GRPOTrainer._compute_loss

    def twice(self, model, inputs):
        self._get_per_token_logps_and_entropies(
            model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
            torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1), inputs["completion_ids"].size(1))
        return own(self, model, inputs)

    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", twice)
    trainer = odb_trl.enable_odb(R.build(dict(loss_type="grpo", max_steps=1), str(tmp_path), R.GradRecorder()),
                                 token_budget=BUDGET)
    with pytest.raises(FrameworkDrift, match=r"called GRPOTrainer._get_per_token_logps_and_entropies 2 times"), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
