"""Every guide's snippet runs as written, on the pinned versions, offline, with a tiny model.

A fenced ``python`` block right under the line ``<!-- odb-snippet: NAME -->`` in README.md or
an integration guide is run unchanged: each in a fresh interpreter (this file, run as a
script), in an empty working folder, after the fixture ``NAME`` below has put there the
names the snippet assumes and does not build itself (``model``, ``tokenizer``, ``dataset``,
``collate_fn``, a ``my_sft.yaml``...: a tiny random Llama, a word-level tokenizer trained on
generated sentences, no download). The fixture then checks what the snippet did (it trained:
finite loss, parameters changed) and that odb raised none of its warnings about silent
mistakes (a forgotten ``pop_step_info``, labels that need ``shift_labels``). Multi-process
snippets run in one process here; tests/project/test_examples.py runs the examples on two.

    python tests/project/test_doc_snippets.py NAME FILE LINE   # what each test runs
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
GUIDES = ["README.md"] + [f"docs/integration-guides/{name}.md"
                          for name in ("hf-trainer", "trl", "llamafactory", "accelerate", "lightning")]
MARK = re.compile(r"^<!-- odb-snippet: ([\w-]+) -->\s*$")


@dataclass(frozen=True)
class Snippet:
    name: str
    path: str
    line: int  # of the first code line
    code: str


def snippets(path: str) -> List[Snippet]:
    """The marked ```python blocks of ``path`` (relative to the repository root)."""
    lines = (ROOT / path).read_text(encoding="utf-8").splitlines()
    out = []
    for i, line in enumerate(lines):
        mark = MARK.match(line)
        if not mark:
            continue
        if i + 1 >= len(lines) or lines[i + 1].strip() != "```python":
            raise ValueError(f"{path}:{i + 1}: the odb-snippet mark must sit on the line right above a ```python "
                             f"fence. Fix: move it there.")
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        out.append(Snippet(mark.group(1), path, i + 3, "\n".join(lines[i + 2:end]) + "\n"))
    return out


# ---- the fixtures (run in the snippet's interpreter) --------------------------------------------------------------
WORDS = ("the cat dog bird sees runs jumps over under a small large red blue green house tree river boat "
         "quickly slowly today yesterday and but with near far old new happy sad").split()


def texts(n: int = 48, seed: int = 0) -> List[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(int(round(2 * 20 ** rng.random())))) for _ in range(n)]


def tiny_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def tiny_llama(tokenizer: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=256, pad_token_id=tokenizer.pad_token_id,
                                        eos_token_id=tokenizer.eos_token_id))


def causal_samples(tokenizer: Any) -> List[Dict[str, Any]]:
    """Tokenized causal-LM samples: labels are the input_ids (the model shifts them)."""
    return [{"input_ids": ids, "labels": list(ids)} for ids in tokenizer(texts())["input_ids"]]


def lm_world() -> Dict[str, Any]:
    """model, tokenizer, dataset (tokenized, with labels), collate_fn (DataCollatorForSeq2Seq), optimizer."""
    import torch
    from transformers import DataCollatorForSeq2Seq

    tokenizer = tiny_tokenizer()
    model = tiny_llama(tokenizer)
    return dict(tokenizer=tokenizer, model=model, dataset=causal_samples(tokenizer),
                collate_fn=DataCollatorForSeq2Seq(tokenizer), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def trained(before: List[Any], model: Any) -> None:
    import torch

    changed = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    if not all(changed):
        raise AssertionError(f"{changed.count(False)} of {len(changed)} parameters did not change: nothing trained")


def snapshot(model: Any) -> List[Any]:
    return [p.detach().clone() for p in model.parameters()]


def plain_loop() -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]:
    ns = lm_world()
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        assert math.isfinite(float(ns["loss"])) and ns["info"].world_size == 1
        assert ns["loader"].odb_stats["samples"] == len(ns["dataset"])
        trained(before, ns["model"])

    return ns, check


def hf_trainer() -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]:
    world = lm_world()
    ns = dict(model=world["model"], ds=world["dataset"], collator=world["collate_fn"])
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        state = ns["trainer"].state
        assert state.global_step > 0 and state.epoch == 2 and math.isfinite(state.log_history[-1]["train_loss"])
        trained(before, ns["model"])

    return ns, check


def readme_trainer() -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]:
    """README's one call: ``trainer`` is a transformers Trainer built without odb."""
    from transformers import Trainer, TrainingArguments

    world = lm_world()
    args = TrainingArguments("out", num_train_epochs=1, per_device_train_batch_size=4, use_cpu=True,
                             report_to="none", disable_tqdm=True, save_strategy="no")
    ns = dict(trainer=Trainer(model=world["model"], args=args, train_dataset=world["dataset"],
                              data_collator=world["collate_fn"]))
    before = snapshot(world["model"])

    def check(ns: Dict[str, Any]) -> None:
        state = ns["trainer"].state
        assert state.global_step > 0 and math.isfinite(state.log_history[-1]["train_loss"])
        assert ns["trainer"].odb_step_infos, "the trainer did not train on odb batches"
        trained(before, world["model"])

    return ns, check


def trl_sft() -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]:
    from datasets import Dataset

    tokenizer = tiny_tokenizer()
    ns = dict(tokenizer=tokenizer, model=tiny_llama(tokenizer), dataset=Dataset.from_dict({"text": texts()}))
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        state = ns["trainer"].state
        assert state.global_step > 0 and state.epoch == 2 and math.isfinite(state.log_history[-1]["train_loss"])
        assert ns["trainer"].odb_step_infos, "the trainer did not train on odb batches"
        trained(before, ns["model"])

    return ns, check


def accelerate_loop() -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]:
    ns = lm_world()
    ns["epochs"] = 2
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        assert type(ns["loader"]).__name__ == "ODBAcceleratedLoader"
        assert ns["loader"].odb_stats["samples"] == len(ns["dataset"])
        trained(before, ns["model"])

    return ns, check


def lightning_fit() -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]:
    ns = lm_world()
    before = snapshot(ns["model"])

    def check(ns: Dict[str, Any]) -> None:
        trainer = ns["trainer"]
        assert trainer.current_epoch == 2 and trainer.global_step > 0
        trained(before, ns["model"])

    return ns, check


def llamafactory_config() -> Dict[str, Any]:
    """An SFT config as LLaMA-Factory's examples write them (warmup_ratio, gradient checkpointing on), offline."""
    sys.path.insert(0, str(ROOT / "examples"))
    from llamafactory_sft import write_demo

    args = write_demo(os.getcwd())
    for name in ("disable_gradient_checkpointing", "use_cpu", "disable_tqdm"):
        args.pop(name)
    args.update(lr_scheduler_type="cosine", warmup_ratio=0.1, output_dir="saves/tiny-llama/sft")
    return args


def llamafactory_run_exp() -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]:
    import json

    import yaml

    with open("my_sft.yaml", "w") as f:
        yaml.safe_dump(llamafactory_config(), f)

    def check(ns: Dict[str, Any]) -> None:
        with open("saves/tiny-llama/sft/trainer_state.json") as f:
            history = json.load(f)["log_history"]
        losses = [h["loss"] for h in history if "loss" in h]
        assert losses and all(math.isfinite(x) for x in losses)
        assert all("odb_mean_batch_size" in h for h in history if "loss" in h)

    return {}, check


def llamafactory_parts() -> Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]:
    """What LLaMA-Factory's run_sft builds before its trainer: model, training_args, collator, dataset_module..."""
    import torch

    from odb.integrations.llamafactory import import_llamafactory

    import_llamafactory()  # before load_model: its gradient checkpointing (on here) needs the transformers 5 fix
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer

    config = {**llamafactory_config(), "use_cpu": True, "disable_tqdm": True}
    config.pop("warmup_ratio")  # run_exp translates it; get_train_args is LLaMA-Factory's own parser
    model_args, data_args, training_args, finetuning_args, _ = get_train_args(config)
    tokenizer_module = load_tokenizer(model_args)
    template = get_template_and_fix_tokenizer(tokenizer_module["tokenizer"], data_args)
    dataset_module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    model = load_model(tokenizer_module["tokenizer"], model_args, finetuning_args, training_args.do_train)
    collator = SFTDataCollatorWith4DAttentionMask(template=template, model=model, pad_to_multiple_of=8,
                                                  label_pad_token_id=-100, **tokenizer_module)
    ns = dict(model=model, training_args=training_args, finetuning_args=finetuning_args, collator=collator,
              dataset_module=dataset_module, tokenizer_module=tokenizer_module,
              optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    before = snapshot(model)

    def check(ns: Dict[str, Any]) -> None:
        if "trainer" in ns:
            state = ns["trainer"].state
            assert state.global_step > 0 and math.isfinite(state.log_history[-1]["train_loss"])
            assert ns["trainer"].odb_step_infos, "the trainer did not train on odb batches"
        else:
            assert ns["handle"].loader.odb_stats["samples"] == len(dataset_module["train_dataset"])
        trained(before, model)

    return ns, check


FIXTURES: Dict[str, Callable[[], Tuple[Dict[str, Any], Callable[[Dict[str, Any]], None]]]] = {
    "readme-quickstart": plain_loop,
    "readme-trainer": readme_trainer,
    "hf-trainer": hf_trainer,
    "trl-sft": trl_sft,
    "llamafactory-run-exp": llamafactory_run_exp,
    "llamafactory-trainer": llamafactory_parts,
    "llamafactory-loop": llamafactory_parts,
    "accelerate-loop": accelerate_loop,
    "lightning-fit": lightning_fit,
}


def run(name: str, path: str, line: int) -> None:
    """Build fixture ``name``, run the snippet of ``path`` at ``line`` unchanged, check what it did."""
    from odb.loader.batch_checks import ShiftLabelsWarning
    from odb.step_info import StepInfoNotPoppedWarning

    snippet = next(s for s in snippets(path) if s.line == line)
    namespace, check = FIXTURES[name]()
    namespace["__name__"] = "__main__"
    with warnings.catch_warnings():
        for silent_mistake in (StepInfoNotPoppedWarning, ShiftLabelsWarning):
            warnings.simplefilter("error", silent_mistake)
        exec(compile(snippet.code, f"{path}:{line}", "exec"), namespace)
    check(namespace)
    print(f"snippet {name} of {path}:{line} ran")


# ---- the tests -----------------------------------------------------------------------------------------------
ALL = [s for path in GUIDES for s in snippets(path)]


def test_every_guide_has_a_runnable_snippet_and_every_mark_a_fixture():
    assert {s.path for s in ALL} == set(GUIDES), "a guide without an <!-- odb-snippet: NAME --> block"
    names = [s.name for s in ALL]
    assert len(set(names)) == len(names) and set(names) == set(FIXTURES), (names, sorted(FIXTURES))


def test_the_mark_must_sit_right_above_a_python_fence(tmp_path, monkeypatch):
    import pytest

    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "guide.md").write_text("<!-- odb-snippet: x -->\n\n```python\npass\n```\n")
    with pytest.raises(ValueError, match="right above a ```python fence"):
        snippets("guide.md")
    (tmp_path / "guide.md").write_text("text\n<!-- odb-snippet: x -->\n```python\na = 1\nb = 2\n```\n")
    assert snippets("guide.md") == [Snippet("x", "guide.md", 4, "a = 1\nb = 2\n")]


def _test(snippet: Snippet) -> Callable[[Any], None]:
    import pytest

    marks = [pytest.mark.timeout(300)]
    if snippet.name.startswith("llamafactory"):
        marks.append(pytest.mark.llamafactory)
        marks.append(pytest.mark.skipif(sys.version_info < (3, 11), reason=(
            "LLaMA-FACTORY SNIPPET NOT RUN: LLaMA-Factory 0.9.5 needs Python >= 3.11 (make test-min runs 3.10); "
            "`make test` runs it on Python 3.11")))
    if snippet.name.startswith("trl"):
        marks.append(pytest.mark.trl)

    def test(tmp_path: Path) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests" / "support")]),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "WANDB_DISABLED": "true"}
        env.pop("DISABLE_VERSION_CHECK", None)  # what a user's shell holds: the integration deals with it
        proc = subprocess.run([sys.executable, __file__, snippet.name, snippet.path, str(snippet.line)],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=280)
        assert proc.returncode == 0, (f"the snippet of {snippet.path}:{snippet.line} fails as written:\n"
                                      f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
        assert f"snippet {snippet.name} of {snippet.path}:{snippet.line} ran" in proc.stdout

    for mark in marks:
        test = mark(test)
    test.__name__ = f"test_snippet_runs_as_written[{snippet.name}]"
    return test


for _snippet in ALL:
    globals()[f"test_snippet_{_snippet.name.replace('-', '_')}_runs_as_written"] = _test(_snippet)


if __name__ == "__main__":
    run(sys.argv[1], sys.argv[2], int(sys.argv[3]))
