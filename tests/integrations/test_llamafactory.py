"""odb in LLaMA-Factory's SFT training: the real CustomSeq2SeqTrainer, collator and data pipeline.

Everything runs offline on CPU: examples/llamafactory_sft.py writes a tiny random Llama,
a word-level tokenizer and multi-turn ShareGPT-style chats to a temporary folder, and the
chats go through LLaMA-Factory's own parser, template, dataset processing and collator
(SFTDataCollatorWith4DAttentionMask).

The example's ``import_llamafactory`` also carries what this environment needs (see
docs/integration-guides/llamafactory.md): LLaMA-Factory 0.9.5 is installed with --no-deps
next to torch 2.13 and transformers 5.24, outside its declared range (transformers<=5.6), so
its version check is disabled with DISABLE_VERSION_CHECK=1; its multimodal plugin imports
torchaudio, for which no build matches torch 2.13 CPU, so a stand-in that fails on use is
registered during the import (the text SFT path never calls it). The demo config sets
disable_gradient_checkpointing (LLaMA-Factory's wrapper fails under transformers 5.23; it
works under 5.6). The same tests pass with transformers 5.6.0, LLaMA-Factory's newest
supported version, without DISABLE_VERSION_CHECK. LLaMA-Factory 0.9.5 imports
``trl.AutoModelForCausalLMWithValueHead``, which TRL 1.x removed, and declares trl<=0.24: `make test`
runs these tests in .venv-lf, beside TRL 0.24, peft 0.18.1 and datasets 4.0.0
(constraints-llamafactory.txt), while .venv holds TRL 1.x.

Where LLaMA-Factory does not import (a failed install), every test here fails with the
reason and the fix, so `make test` cannot pass without it. They skip only where
LLaMA-Factory cannot be installed at all: Python below 3.11, which LLaMA-Factory 0.9.5
requires (``make test-min`` runs on Python 3.10), and the skip says so.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import numpy as np
import pytest
import torch

LLAMAFACTORY_PYTHON = (3, 11)  # LLaMA-Factory 0.9.5's Requires-Python
if sys.version_info < LLAMAFACTORY_PYTHON:
    pytest.skip(f"LLaMA-FACTORY TESTS NOT RUN: LLaMA-Factory 0.9.5 requires Python >= 3.11 and this is Python "
                f"{sys.version.split()[0]}, so it cannot be installed here; `make test` runs them on Python 3.11",
                allow_module_level=True)


def _load_example() -> Tuple[Any, Optional[str]]:
    """The example module, and why LLaMA-Factory does not import (None when it does)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "llamafactory_sft.py"
    spec = importlib.util.spec_from_file_location("odb_example_llamafactory_sft", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.import_llamafactory()
    except ImportError as err:
        return module, (f"LLaMA-Factory does not import ({type(err).__name__}: {err}), so its integration is "
                        f"untested: a failed install fails these tests instead of skipping them. Fix: `make venv` "
                        f"installs it (`make venv-lf`: pip install --no-deps -c constraints-llamafactory.txt llamafactory "
                        f"peft trl datasets ...: see the Makefile), or repair that install")
    return module, None


example, IMPORT_ERROR = _load_example()

if IMPORT_ERROR is None:
    from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer
    from llamafactory.hparams import get_train_args
    from llamafactory.model import load_model, load_tokenizer
    from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer
from torch.utils.data import DataLoader  # noqa: E402
from transformers import LlamaForCausalLM, TrainerCallback  # noqa: E402

import odb  # noqa: E402
from odb.integrations import llamafactory as odb_lf  # noqa: E402
from odb.integrations.llamafactory_compat import transformers5_args  # noqa: E402

pytestmark = [pytest.mark.llamafactory, pytest.mark.timeout(240)]


@pytest.fixture(scope="module", autouse=True)
def llamafactory_imports() -> None:
    """Fail every test of this module (before its other fixtures) where LLaMA-Factory does not import."""
    if IMPORT_ERROR is not None:
        pytest.fail(IMPORT_ERROR, pytrace=False)

BUDGET = 512
CUTOFF = 128


# ---- an offline LLaMA-Factory setup ---------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dict[str, Any]]:
    from transformers.utils import logging

    verbosity = logging.get_verbosity()  # LLaMA-Factory's argument parser turns transformers' logging to INFO
    root = str(tmp_path_factory.mktemp("llamafactory"))
    args = example.write_demo(root)
    assert args["cutoff_len"] == CUTOFF
    yield {"root": root, "args": args}
    logging.set_verbosity(verbosity)


def sft_args(setup: Dict[str, Any], name: str, **changes: Any) -> Dict[str, Any]:
    return {**setup["args"], "output_dir": os.path.join(setup["root"], name), **changes}


def build_sft(setup: Dict[str, Any], name: str, **changes: Any) -> Dict[str, Any]:
    """What LLaMA-Factory's run_sft builds before trainer.train(), step by step."""
    model_args, data_args, training_args, finetuning_args, _ = get_train_args(sft_args(setup, name, **changes))
    tokenizer_module = load_tokenizer(model_args)
    tokenizer = tokenizer_module["tokenizer"]
    template = get_template_and_fix_tokenizer(tokenizer, data_args)
    dataset_module = get_dataset(template, model_args, data_args, training_args, stage="sft", **tokenizer_module)
    model = load_model(tokenizer, model_args, finetuning_args, training_args.do_train)
    collator = SFTDataCollatorWith4DAttentionMask(
        template=template, model=model, pad_to_multiple_of=8 if training_args.do_train else None,
        label_pad_token_id=-100 if data_args.ignore_pad_token_for_loss else tokenizer.pad_token_id,
        block_diag_attn=model_args.block_diag_attn, neat_packing=data_args.neat_packing,
        attn_implementation=getattr(model.config, "_attn_implementation", None),
        compute_dtype=model_args.compute_dtype, **tokenizer_module)
    return dict(model=model, args=training_args, finetuning_args=finetuning_args, collator=collator,
                dataset_module=dataset_module, tokenizer_module=tokenizer_module)


def make_trainer(parts: Dict[str, Any]) -> CustomSeq2SeqTrainer:
    return CustomSeq2SeqTrainer(model=parts["model"], args=parts["args"], finetuning_args=parts["finetuning_args"],
                                data_collator=parts["collator"], **parts["dataset_module"],
                                **parts["tokenizer_module"])


class BatchRecorder(TrainerCallback):
    """Records (rows, padded length, real tokens) of every forward the model runs in training and,
    given the trainer, (epoch, sample ids) of every optimizer step."""

    def __init__(self, trainer: Any = None) -> None:
        self.trainer = trainer
        self.batches: List[Tuple[int, int, int]] = []
        self.steps: List[Tuple[float, List[int]]] = []
        self.extra_keys: set = set()

    def hook(self, module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        if module.training:
            ids, mask = kwargs["input_ids"], kwargs["attention_mask"]
            self.batches.append((int(ids.shape[0]), int(ids.shape[1]), int(mask.sum())))
            self.extra_keys |= set(kwargs) - {"input_ids", "attention_mask", "labels", "use_cache",
                                               "num_items_in_batch", "position_ids"}

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.trainer is not None:
            self.steps.append((state.epoch, [i for info in self.trainer.odb_step_infos for i in info.sample_ids]))


def fixed_batching_padding(lengths: np.ndarray, budget: int, seed: int = 0) -> Tuple[float, int]:
    """Padding ratio and batch count of the largest fixed batch size whose worst case fits ``budget``."""
    padded = -(-lengths // 8) * 8
    size = budget // (-(-CUTOFF // 8) * 8)
    order = np.random.default_rng(seed).permutation(len(lengths))
    cost = sum(len(chunk) * padded[chunk].max() for chunk in np.array_split(order, math.ceil(len(order) / size)))
    return 1.0 - lengths.sum() / cost, math.ceil(len(order) / size)


def check_odb_batches(batches: List[Tuple[int, int, int]], lengths: np.ndarray, epochs: int,
                      fewer_steps: bool = True) -> None:
    rows = [b for b, _, _ in batches]
    assert sum(rows) == epochs * len(lengths), "every sample once per epoch"
    assert all(b * length <= BUDGET and length % 8 == 0 for b, length, _ in batches), batches
    assert len(set(rows)) > 2, f"batch sizes do not vary: {batches}"
    # the batch with the most rows holds shorter samples, and more of them, than the longest batch (the shortest
    # batch may be an epoch's remainder of a few samples)
    most, longest = max(batches, key=lambda t: t[0]), max(batches, key=lambda t: t[1])
    assert most[0] > longest[0] and most[1] < longest[1], "short samples should get larger batches than long ones"
    odb_padding = 1.0 - sum(r for _, _, r in batches) / sum(b * length for b, length, _ in batches)
    fixed_padding, fixed_steps = fixed_batching_padding(lengths, BUDGET)
    assert odb_padding < fixed_padding, (odb_padding, fixed_padding)
    if fewer_steps:  # budget-filled steps; the Trainer's own steps trade micro-batches for padding (least cost)
        assert len(batches) < epochs * fixed_steps


def dataset_lengths(parts: Dict[str, Any]) -> np.ndarray:
    return np.array([len(x) for x in parts["dataset_module"]["train_dataset"]["input_ids"]])


# ---- the trainer -------------------------------------------------------------------------------
def test_custom_seq2seq_trainer_trains_on_odb_batches(setup):
    parts = build_sft(setup, "trainer", gradient_accumulation_steps=2)
    lengths = dataset_lengths(parts)
    assert lengths.max() <= CUTOFF and lengths.min() < CUTOFF // 4  # LLaMA-Factory's template and truncation
    trainer = make_trainer(parts)
    recorder = BatchRecorder()
    trainer.add_callback(recorder)
    assert odb_lf.enable_odb(trainer=trainer, token_budget=BUDGET, buffer_size=16) is trainer
    assert trainer.odb_config.pad_to_multiple_of == 8  # from the collator
    # the Trainer's batch: per-device batch x accumulation 2 samples per optimizer step, micro-batches by odb
    assert trainer.odb_config.global_batch_size == trainer.args.per_device_train_batch_size * 2
    assert trainer.odb_config.gradient_accumulation_steps == 1
    result = trainer.train()

    assert math.isfinite(result.training_loss)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    assert all("odb_mean_batch_size" in h for h in trainer.state.log_history if "loss" in h)
    assert not recorder.extra_keys, "odb's step info reached the model"  # it was popped from every batch
    assert trainer.odb_step_infos and all(isinstance(i, odb.ODBStepInfo) for i in trainer.odb_step_infos)
    check_odb_batches(recorder.batches, lengths, epochs=2, fewer_steps=False)


def test_run_exp_runs_llamafactorys_sft_workflow_with_odb(setup):
    from llamafactory.train.sft import workflow

    original = workflow.CustomSeq2SeqTrainer
    recorder = BatchRecorder()
    args = sft_args(setup, "run_exp", num_train_epochs=1)
    # budget-filled steps (the explicit choice): the batches below are sized by the budget alone
    odb_lf.run_exp(args, callbacks=[recorder], token_budget=BUDGET, buffer_size=16, global_batch_size=None)

    assert workflow.CustomSeq2SeqTrainer is original
    with open(os.path.join(args["output_dir"], "train_results.json")) as f:
        assert math.isfinite(json.load(f)["train_loss"])
    with open(os.path.join(args["output_dir"], "trainer_log.jsonl")) as f:  # LLaMA-Factory's LogCallback
        logged = [json.loads(line) for line in f]
    assert logged and all(math.isfinite(x["loss"]) for x in logged if "loss" in x)
    assert not recorder.extra_keys
    parts = build_sft(setup, "lengths")
    check_odb_batches(recorder.batches, dataset_lengths(parts), epochs=1)


def sft_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """One rank of dist_harness.run_ranks: LLaMA-Factory's SFT trainer with odb, two epochs."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")  # the harness joined gloo already; accelerate reads these
    parts = build_sft(p, "ranks", gradient_accumulation_steps=2)
    trainer = odb_lf.enable_odb(trainer=make_trainer(parts), token_budget=BUDGET, buffer_size=8)
    recorder = BatchRecorder(trainer)
    trainer.add_callback(recorder)
    result = trainer.train()
    return {"loss": result.training_loss, "steps": recorder.steps, "batches": recorder.batches,
            "samples": len(parts["dataset_module"]["train_dataset"]),
            "params": {n: w.detach().clone() for n, w in trainer.model.named_parameters()}}


@pytest.mark.dist
def test_two_ranks_split_the_data_exactly_once_and_stay_in_sync(setup, tmp_path):
    from dist_harness import run_ranks

    ranks = run_ranks("test_llamafactory:sft_ranks", 2, setup, tmp_path, deadline_s=200)
    assert all(math.isfinite(r["loss"]) for r in ranks)
    assert len(ranks[0]["steps"]) == len(ranks[1]["steps"]) > 0
    for epoch in (0, 1):
        seen = sorted(i for r in ranks for e, ids in r["steps"] if epoch < e <= epoch + 1 for i in ids)
        assert seen == list(range(ranks[0]["samples"])), f"epoch {epoch}: not every sample exactly once"
    assert all(b * length <= BUDGET for r in ranks for b, length, _ in r["batches"])
    assert len({b for r in ranks for b, _, _ in r["batches"]}) > 2
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name]), f"DDP replicas diverged at {name}"


# ---- a loop of your own ---------------------------------------------------------------------------
def test_own_loop_with_llamafactorys_collator_has_exact_gradients(setup):
    parts = build_sft(setup, "loop", gradient_accumulation_steps=2, seed=3)
    dataset, collator = parts["dataset_module"]["train_dataset"].select(range(24)), parts["collator"]
    loader = DataLoader(dataset, batch_size=1, shuffle=True, collate_fn=collator)
    handle = odb_lf.enable_odb(train_dataloader=loader, training_args=parts["args"], token_budget=BUDGET,
                               buffer_size=16)
    assert handle.loader is loader
    per_step = parts["args"].per_device_train_batch_size * 2  # the Trainer's samples per optimizer step
    assert (handle.config.pad_to_multiple_of, handle.config.global_batch_size, handle.config.seed,
            handle.config.shift_labels) == (8, per_step, 3, True)

    torch.manual_seed(0)
    model = LlamaForCausalLM(parts["model"].config).double()
    reference = LlamaForCausalLM(parts["model"].config).double()
    reference.load_state_dict(model.state_dict())
    step_ids: List[int] = []
    seen: List[int] = []
    sizes: List[int] = []
    worst = 0.0
    for batch in loader:
        info = odb.pop_step_info(batch)
        assert batch["input_ids"].shape[0] * batch["input_ids"].shape[1] <= BUDGET
        assert int(batch["labels"][:, 1:].ne(-100).sum()) == info.local_loss_tokens
        (model(**batch).loss * info.loss_scale).backward()
        step_ids += info.sample_ids
        if info.is_last_micro_step:  # compare with the token mean over the step's samples, one at a time
            total = 0
            for i in step_ids:
                one = collator([dataset[i]])
                n = int(one["labels"][:, 1:].ne(-100).sum())
                (reference(**one).loss * n).backward()
                total += n
            for p, q in zip(model.parameters(), reference.parameters()):
                worst = max(worst, float((p.grad - q.grad / total).abs().max() / (q.grad / total).abs().max()))
                p.grad, q.grad = None, None
            seen += step_ids
            sizes.append(len(step_ids))
            step_ids = []
    assert sorted(seen) == list(range(len(dataset)))
    assert sizes == [per_step] * (len(dataset) // per_step) + ([len(dataset) % per_step] if len(dataset) % per_step
                                                               else [])
    assert worst < 1e-5, worst  # transformers' causal-LM loss runs in float32 (logits.float()) even for a
    # float64 model; averaging the micro-batch means instead (scale 1/micro_steps) is off by ~10 here


# ---- neat_packing: odb's packed rows ---------------------------------------------------------------
NEAT = dict(neat_packing=False, train_on_prompt=True, max_grad_norm=0.0, gradient_accumulation_steps=2, seed=5)
# train_on_prompt: each sample's first label is a real token, so a row that did not mask it (or leaked attention
# between samples) would train on other samples' tokens; max_grad_norm=0: no clipping between step and reference


def build_neat(setup: Dict[str, Any], name: str, **changes: Any) -> Dict[str, Any]:
    """build_sft with the dataset unpacked and the collator of `neat_packing: true` (as run_exp builds them)."""
    parts = build_sft(setup, name, **{**NEAT, **changes})
    parts["collator"].neat_packing = parts["collator"].block_diag_attn = True
    return parts


class StepGradients(TrainerCallback):
    """Every forward's (rows, length, position restarts) and, at each optimizer step before it runs, the
    gradients and the sample ids of the step on this rank."""

    def __init__(self, trainer: Any) -> None:
        self.trainer, self.forwards, self.steps = trainer, [], []

    def hook(self, module: Any, args: Any, kwargs: Dict[str, Any]) -> None:
        if module.training:
            ids, positions = kwargs["input_ids"], kwargs.get("position_ids")
            starts = -1 if positions is None else int(positions.eq(0).sum())
            self.forwards.append((int(ids.shape[0]), int(ids.shape[1]), starts, kwargs.get("attention_mask")))

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        model.register_forward_pre_hook(self.hook, with_kwargs=True)

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        ids = [i for info in self.trainer.odb_step_infos for i in info.sample_ids]
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
        self.steps.append((ids, grads))


def reference_gradients(parts: Dict[str, Any], state: Dict[str, torch.Tensor], ids: List[int]) -> Dict[str, Any]:
    """The gradient of the token mean over samples ``ids``, each run alone (float64)."""
    reference = LlamaForCausalLM(parts["model"].config).double()
    reference.load_state_dict(state)
    dataset, total = parts["dataset_module"]["train_dataset"], 0
    for i in ids:
        ids_, labels = (torch.tensor([dataset[i][k]]) for k in ("input_ids", "labels"))
        n = int(labels[:, 1:].ne(-100).sum())
        logits = reference(input_ids=ids_).logits[0, :-1].double()
        torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=-100, reduction="sum").backward()
        total += n
    return {n: p.grad / total for n, p in reference.named_parameters()}


def assert_close_gradients(got: Dict[str, torch.Tensor], want: Dict[str, torch.Tensor], bound: float) -> None:
    worst = max(float((got[n].double() - want[n]).abs().max() / want[n].abs().max()) for n in want)
    assert worst < bound, worst


def test_neat_packing_trains_odb_packed_rows_and_one_step_equals_the_reference(setup, caplog):
    import logging

    parts = build_neat(setup, "neat", max_steps=1)
    state = {k: v.detach().clone().double() for k, v in parts["model"].state_dict().items()}
    before = parts["model"].config._attn_implementation
    with caplog.at_level(logging.WARNING, logger="odb.packed.models"):
        trainer = odb_lf.enable_odb(trainer=make_trainer(parts), token_budget=BUDGET, buffer_size=16)
    assert trainer.odb_config.layout == "packed" and trainer.odb_config.pad_to_multiple_of == 1
    # the trainer path switches a dense-mask model to per-sample attention, saying so once
    assert before in ("sdpa", "eager") and trainer.model.config._attn_implementation == "odb_varlen"
    assert len([r for r in caplog.records if f"switched from {before!r} to 'odb_varlen'" in r.getMessage()]) == 1
    assert isinstance(trainer.data_collator, odb.PackedCollate)
    recorder = StepGradients(trainer)
    trainer.add_callback(recorder)
    trainer.train()

    assert len(recorder.steps) == 1 and len(recorder.forwards) == 2  # one step of two packed rows
    ids, grads = recorder.steps[0]
    lengths = dataset_lengths(parts)
    for (rows, length, starts, mask), info in zip(recorder.forwards, trainer.odb_step_infos):
        # one padding-free row, positions restarting at every sample, no attention mask (transformers builds the
        # block-diagonal mask from position_ids)
        assert (rows, length, starts, mask) == (1, int(lengths[list(info.sample_ids)].sum()), len(info.sample_ids),
                                                None)
        assert length <= BUDGET and len(info.sample_ids) > 1
    assert_close_gradients(grads, reference_gradients(parts, state, ids), 1e-4)


def test_odb_enable_odb_takes_llamafactorys_trainer(setup):
    """``odb.enable_odb(trainer)``, the one call for every trainer, sends LLaMA-Factory's trainer down LLaMA-Factory's
    path: the collator's neat_packing becomes packed rows (the plain transformers path would pad), and it trains."""
    parts = build_neat(setup, "neat-enable", max_steps=1)
    trainer = make_trainer(parts)
    assert odb.enable_odb(trainer, token_budget=BUDGET, buffer_size=16) is trainer
    assert trainer.odb_config.layout == "packed" and isinstance(trainer.data_collator, odb.PackedCollate)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.train()
    assert trainer.state.global_step == 1 and trainer.odb_step_infos
    assert all(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters() if n in before)


def test_run_exp_maps_neat_packing_onto_packed_rows_of_unpacked_samples(setup):
    seen: List[Any] = []

    class Rows(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, train_dataloader: Any = None,
                           **kwargs: Any) -> None:
            seen.append(train_dataloader)
            model.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["position_ids"]), with_kwargs=True)

    args = sft_args(setup, "run_exp_neat", num_train_epochs=1, neat_packing=True)
    odb_lf.run_exp(args, callbacks=[Rows()], token_budget=BUDGET, buffer_size=16)

    loader, rows = seen[0], seen[1:]
    assert loader.odb_config.layout == "packed"
    assert len(loader.dataset) == len(json.load(open(os.path.join(args["dataset_dir"], "chats.json"))))  # unpacked
    assert rows and all(r.shape[0] == 1 and r.shape[1] <= BUDGET for r in rows)
    samples = sum(int(r.eq(0).sum()) for r in rows)
    assert samples == len(loader.dataset), "every sample once, each starting a new position run"
    with open(os.path.join(args["output_dir"], "train_results.json")) as f:
        assert math.isfinite(json.load(f)["train_loss"])


def neat_ranks(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """One rank of dist_harness.run_ranks: LLaMA-Factory's SFT trainer with neat_packing, one optimizer step."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")  # the harness joined gloo already; accelerate reads these
    parts = build_neat(p, "neat_ranks", max_steps=1)
    state = {k: v.detach().clone() for k, v in parts["model"].state_dict().items()}
    trainer = odb_lf.enable_odb(trainer=make_trainer(parts), token_budget=BUDGET, buffer_size=8)
    recorder = StepGradients(trainer)
    trainer.add_callback(recorder)
    trainer.train()
    ids, grads = recorder.steps[0]
    return {"ids": ids, "grads": grads, "state": state, "layout": trainer.odb_config.layout,
            "rows": [f[0] for f in recorder.forwards]}


@pytest.mark.dist
def test_two_ranks_neat_packing_step_equals_the_single_process_reference(setup, tmp_path):
    from dist_harness import run_ranks

    ranks = run_ranks("test_llamafactory:neat_ranks", 2, setup, tmp_path, deadline_s=200)
    assert all(r["layout"] == "packed" and set(r["rows"]) == {1} for r in ranks)
    ids = ranks[0]["ids"] + ranks[1]["ids"]
    assert len(set(ids)) == len(ids) and ranks[0]["ids"] and ranks[1]["ids"], "the ranks share the step's samples"
    parts = build_neat(setup, "neat_reference")
    state = {k: v.double() for k, v in ranks[0]["state"].items()}
    want = reference_gradients(parts, state, ids)
    for r in ranks:  # DDP averaged the ranks' gradients: each equals the token mean over both ranks' samples
        assert_close_gradients(r["grads"], want, 1e-4)


# ---- what is refused -----------------------------------------------------------------------------
def test_refuses_settings_that_break_odb_batches(setup):
    parts = build_sft(setup, "errors")
    with pytest.raises(ValueError, match="both trainer and train_dataloader"):
        odb_lf.enable_odb(trainer=make_trainer(parts), train_dataloader=DataLoader([]), token_budget=BUDGET)
    with pytest.raises(ValueError, match=r"sample \d+ has \d+ tokens.*raise token_budget to at least"):
        odb_lf.enable_odb(trainer=make_trainer(parts), token_budget=64)
    with pytest.raises(ValueError, match="pad_to_multiple_of=4 but SFTDataCollatorWith4DAttentionMask pads"):
        odb_lf.enable_odb(trainer=make_trainer(parts), token_budget=BUDGET, pad_to_multiple_of=4)
    with pytest.raises(ValueError, match="training_args that are not trainer.args"):
        odb_lf.enable_odb(trainer=make_trainer(parts), training_args=build_sft(setup, "other")["args"],
                          token_budget=BUDGET)

    unpadded = build_sft(setup, "label_pad", ignore_pad_token_for_loss=False)
    with pytest.raises(ValueError, match="ignore_pad_token_for_loss: true"):
        odb_lf.enable_odb(trainer=make_trainer(unpadded), token_budget=BUDGET)

    ordered = build_sft(setup, "ordered", disable_shuffling=True)
    with pytest.raises(ValueError, match="train_sampling_strategy: sequential"):
        odb_lf.enable_odb(trainer=make_trainer(ordered), token_budget=BUDGET)
    sequential = build_sft(setup, "sequential", disable_shuffling=True, train_sampling_strategy="sequential")
    odb_lf.enable_odb(trainer=make_trainer(sequential), token_budget=BUDGET)

    # neat_packing: odb's packed rows, or a refusal naming the fix
    flash = SFTDataCollatorWith4DAttentionMask(template=parts["collator"].template, pad_to_multiple_of=8,
                                               neat_packing=True, attn_implementation="flash_attention_2",
                                               **parts["tokenizer_module"])
    # a batch of 4 (odb keeps it per optimizer step), packed into rows under the budget
    loader = DataLoader(parts["dataset_module"]["train_dataset"], batch_size=4, collate_fn=flash)
    handle = odb_lf.enable_odb(train_dataloader=loader, token_budget=BUDGET)  # was refused before packed rows
    assert handle.config.layout == "packed" and handle.config.pad_to_multiple_of == 1
    row = next(iter(loader))
    assert row["input_ids"].shape[0] == 1 and "attention_mask" not in row and row["position_ids"].eq(0).sum() > 1

    prepacked = build_sft(setup, "prepacked", neat_packing=True)  # LLaMA-Factory packed the dataset at get_dataset
    with pytest.raises(ValueError, match=r"already packed into rows by LLaMA-Factory.*Fix: use "
                                         r"odb.integrations.llamafactory.run_exp"):
        odb_lf.enable_odb(trainer=make_trainer(prepacked), token_budget=BUDGET)
    with pytest.raises(ValueError, match="already packed into rows"):  # packing: true (cross-attending rows) too
        odb_lf.enable_odb(trainer=make_trainer(build_sft(setup, "packing", packing=True)), token_budget=BUDGET)
    neat = build_neat(setup, "neat_errors")
    with pytest.raises(ValueError, match=r"layout='padded' but SFTDataCollatorWith4DAttentionMask has "
                                         r"neat_packing=True.*Fix: leave layout out"):
        odb_lf.enable_odb(trainer=make_trainer(neat), token_budget=BUDGET, layout="padded")
    with pytest.raises(ValueError, match=r"pad_to_multiple_of=8 with neat_packing.*Fix: leave pad_to_multiple_of"):
        odb_lf.enable_odb(trainer=make_trainer(neat), token_budget=BUDGET, pad_to_multiple_of=8)
    with pytest.raises(ValueError, match=r"ignore_index=-1 with packed rows"):
        odb_lf.enable_odb(trainer=make_trainer(neat), token_budget=BUDGET, ignore_index=-1)
    trainer = make_trainer(neat)
    collator = trainer.data_collator
    with pytest.raises(ValueError, match=r"sample \d+ has \d+ tokens"):  # a failed enable leaves the collator
        odb_lf.enable_odb(trainer=trainer, token_budget=16)
    assert trainer.data_collator is collator

    from transformers import OPTConfig, OPTForCausalLM  # OPT's attention ignores packed-row boundaries

    opt = OPTForCausalLM(OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32,
                                   num_attention_heads=2, max_position_embeddings=256))
    mixing = SFTDataCollatorWith4DAttentionMask(template=parts["collator"].template, model=opt, neat_packing=True,
                                                attn_implementation="sdpa", **parts["tokenizer_module"])
    loader = DataLoader(parts["dataset_module"]["train_dataset"], batch_size=1, collate_fn=mixing)
    with pytest.raises(odb.PackedLayoutError, match=r"neat_packing: true trains on odb's packed rows, and odb "
                                                    r"refuses layout='packed' for OPTForCausalLM.*set `neat_packing: "
                                                    r"false`"):  # OPT's own attention; odb_varlen would isolate it
        odb_lf.enable_odb(train_dataloader=loader, token_budget=BUDGET, packed_attention="model")
    handle = odb_lf.enable_odb(train_dataloader=loader, token_budget=BUDGET)  # switched to odb_varlen: exact
    assert opt.config._attn_implementation == "odb_varlen"
    handle.remove()

    with pytest.raises(ValueError, match="stage='pt'"):
        odb_lf.run_exp(sft_args(setup, "pt", stage="pt"), token_budget=BUDGET)


# ---- a failed install ----------------------------------------------------------------------------
def test_a_failed_install_fails_these_tests_instead_of_skipping_them(tmp_path):
    broken = tmp_path / "site" / "llamafactory"  # shadows the installed package, as a broken install would
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('simulated: a dependency of LLaMA-Factory is missing')\n")
    path = [str(broken.parent)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=-ra",
                           "-k", "not a_failed_install", __file__], cwd=str(Path(__file__).resolve().parents[2]),
                          env=env, capture_output=True, text=True, timeout=200)
    out = proc.stdout + proc.stderr
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 1, out[-3000:]
    # every test ends in an error of the fixture above: none passed, none was skipped
    errors = re.search(r"(\d+) errors?", summary)
    others = [name for name in globals() if name.startswith("test_") and "a_failed_install" not in name]
    assert errors and int(errors.group(1)) == len(others) and not re.search(r"passed|skipped", summary), \
        out[-3000:]
    assert "LLaMA-Factory does not import (ImportError: simulated: a dependency of LLaMA-Factory is missing)" in out
    assert "Fix: `make venv` installs it" in out


# ---- LLaMA-Factory 0.9.5 on transformers 5: what run_exp / import_llamafactory do for the user ----------------------
def test_gradient_checkpointing_of_llamafactory_trains_on_transformers_5(setup):
    """LLaMA-Factory's checkpointing wrapper reads func.__self__, which transformers 5.23's partial(forward, layer)
    lacks; after import_llamafactory the layer reaches it as a bound method and a step runs under checkpointing."""
    odb_lf.import_llamafactory()
    parts = build_sft(setup, "checkpointing", disable_gradient_checkpointing=False)
    model = parts["model"]
    assert model.is_gradient_checkpointing
    calls = []
    layer = model.model.layers[0]
    checkpoint_func = layer._gradient_checkpointing_func
    layer._gradient_checkpointing_func = lambda func, *a, **k: calls.append(func) or checkpoint_func(func, *a, **k)
    samples = [parts["dataset_module"]["train_dataset"][i] for i in range(3)]
    batch = parts["collator"](samples)
    model.train()
    loss = model(**{k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}).loss
    loss.backward()
    assert math.isfinite(float(loss)) and calls, "the layer did not run through gradient checkpointing"
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_warmup_ratio_becomes_warmup_steps_on_transformers_5():
    import transformers

    if hasattr(transformers.TrainingArguments, "warmup_ratio"):
        pytest.skip("this transformers still has warmup_ratio: run_exp passes it through")
    with pytest.warns(UserWarning, match=r"warmup_ratio=0.1 as warmup_steps=0.1.*Fix, to silence this: write "
                                         r"warmup_steps: 0.1"):
        assert transformers5_args({"stage": "sft", "warmup_ratio": 0.1}) == {"stage": "sft",
                                                                                      "warmup_steps": 0.1}
    with pytest.warns(UserWarning, match="warmup_steps=0.05"):
        assert transformers5_args(["--stage", "sft", "--warmup_ratio", "0.05"]) == \
            ["--stage", "sft", "--warmup_steps", "0.05"]
    assert transformers5_args({"warmup_steps": 10}) == {"warmup_steps": 10}
    with pytest.raises(ValueError, match="both warmup_ratio=0.1 and warmup_steps.*Fix: keep one"):
        transformers5_args({"warmup_ratio": 0.1, "warmup_steps": 5})
    with pytest.raises(ValueError, match=r"warmup_ratio=2.*\[0, 1\)"):
        transformers5_args(["--warmup_ratio=2"])


# ---- the Trainer's schedule, kept --------------------------------------------------------------------
def schedule_run(setup: Dict[str, Any], name: str, with_odb: bool, resume: Optional[str] = None,
                 **changes: Any) -> Dict[str, Any]:
    """LLaMA-Factory's SFT trainer, with or without odb: 48 chats in order, steps of 5 x 2 (each epoch ends with a
    step of 8), a cosine schedule with warmup, plain SGD; the learning rate after each step and the parameters."""
    class Rates(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            rates.append(trainer.lr_scheduler.get_last_lr()[0])
            if with_odb:
                micro.append(len(trainer.odb_step_infos))

    options = dict(per_device_train_batch_size=5, gradient_accumulation_steps=2, optim="sgd", learning_rate=0.05,
                   weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="cosine", warmup_steps=2,
                   disable_shuffling=True, train_sampling_strategy="sequential", logging_steps=100)
    parts = build_sft(setup, name, **{**options, **changes})
    trainer, rates, micro = make_trainer(parts), [], []
    if with_odb:
        odb_lf.enable_odb(trainer=trainer, token_budget=BUDGET, buffer_size=16)
    trainer.add_callback(Rates())
    before = {n: w.detach().clone() for n, w in trainer.model.named_parameters()}
    trainer.train(resume_from_checkpoint=resume)
    return {"rates": rates, "steps": trainer.state.global_step, "before": before,
            "params": {n: w.detach().clone() for n, w in trainer.model.named_parameters()},
            "micro": micro, "rng": torch.get_rng_state()}


def update_gap(plain: Dict[str, Any], other: Dict[str, Any]) -> float:
    start = plain["before"]
    ref = {n: plain["params"][n] - start[n] for n in start}
    scale = max(float(d.abs().max()) for d in ref.values())
    return max(float((other["params"][n] - start[n] - ref[n]).abs().max()) for n in ref) / scale


def test_the_trainers_schedule_runs_unchanged_with_odb_and_across_a_resume(setup):
    """With the user's batch odb keeps LLaMA-Factory's (the Trainer's) steps, so its cosine schedule with warmup
    gives the same learning rate at every step and the same updates as without odb, an epoch's partial last
    step included, and so does a run resumed from a checkpoint in the middle of the first epoch."""
    plain = schedule_run(setup, "plain", False)
    with_odb = schedule_run(setup, "odb", True, save_strategy="steps", save_steps=3)
    assert plain["steps"] == with_odb["steps"] == 2 * 5
    assert with_odb["rates"] == plain["rates"], "odb's learning rates are not the Trainer's"
    assert any(m != 2 for m in with_odb["micro"]), "odb did not cut the steps into micro-batches of its own"
    gap = update_gap(plain, with_odb)
    checkpoint = os.path.join(setup["root"], "odb", "checkpoint-3")
    resumed = schedule_run(setup, "resumed", True, resume=checkpoint)
    assert resumed["rates"] == plain["rates"][3:]
    resumed["before"] = plain["before"]
    resumed_gap = update_gap(plain, resumed)
    print(f"LLaMA-Factory: relative update gap {gap:.1e}, resumed at step 3 of 5: {resumed_gap:.1e}")
    assert gap <= 1e-5 and resumed_gap <= 1e-5


def test_group_by_length_keeps_llamafactorys_steps(setup):
    """LLaMA-Factory's trainer samples through the Trainer's own sampler when it shuffles, so under
    group_by_length odb keeps its steps as it keeps the Trainer's (tests/integrations/test_hf_sampling.py): the
    same learning rates and updates over two epochs (odb reads the samples' lengths from LLaMA-Factory's
    dataset), and torch's RNG left where the Trainer leaves it (its LengthGroupedSampler draws from it)."""
    grouped = dict(disable_shuffling=False, train_sampling_strategy="group_by_length")
    plain = schedule_run(setup, "grouped_plain", False, **grouped)
    with_odb = schedule_run(setup, "grouped_odb", True, **grouped)
    assert plain["steps"] == with_odb["steps"] == 2 * 5 and with_odb["rates"] == plain["rates"]
    assert any(m != 2 for m in with_odb["micro"]), "odb did not cut the steps into micro-batches of its own"
    assert torch.equal(with_odb["rng"], plain["rng"])
    gap = update_gap(plain, with_odb)
    print(f"LLaMA-Factory, group_by_length: relative update gap {gap:.1e}")
    assert gap <= 1e-5
