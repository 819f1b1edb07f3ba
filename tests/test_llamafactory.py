"""odb in LLaMA-Factory's SFT training: the real CustomSeq2SeqTrainer, collator and data pipeline.

Everything runs offline on CPU: examples/llamafactory_sft.py writes a tiny random Llama,
a word-level tokenizer and multi-turn ShareGPT-style chats to a temporary folder, and the
chats go through LLaMA-Factory's own parser, template, dataset processing and collator
(SFTDataCollatorWith4DAttentionMask).

The example's ``import_llamafactory`` also carries what this environment needs (see
docs/integration-guides/llamafactory.md): LLaMA-Factory 0.9.5 is installed with --no-deps
next to torch 2.13 and transformers 5.23, outside its declared range (transformers<=5.6), so
its version check is disabled with DISABLE_VERSION_CHECK=1; its multimodal plugin imports
torchaudio, for which no build matches torch 2.13 CPU, so a stand-in that fails on use is
registered during the import (the text SFT path never calls it). The demo config sets
disable_gradient_checkpointing (LLaMA-Factory's wrapper fails under transformers 5.23; it
works under 5.6). The same tests pass with transformers 5.6.0, LLaMA-Factory's newest
supported version, without DISABLE_VERSION_CHECK.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")


def _load_example() -> Any:
    path = Path(__file__).resolve().parents[1] / "examples" / "llamafactory_sft.py"
    spec = importlib.util.spec_from_file_location("odb_example_llamafactory_sft", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    try:
        module.import_llamafactory()
    except ImportError as err:
        pytest.skip(f"LLaMA-Factory does not import ({err}). Install it as the Makefile's venv step does: "
                    f"pip install --no-deps -c constraints.txt llamafactory peft trl datasets ...",
                    allow_module_level=True)
    return module


example = _load_example()

from llamafactory.data import SFTDataCollatorWith4DAttentionMask, get_dataset, get_template_and_fix_tokenizer  # noqa
from llamafactory.hparams import get_train_args  # noqa: E402
from llamafactory.model import load_model, load_tokenizer  # noqa: E402
from llamafactory.train.sft.trainer import CustomSeq2SeqTrainer  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import LlamaForCausalLM, TrainerCallback  # noqa: E402

import odb  # noqa: E402
from odb.integrations import llamafactory as odb_lf  # noqa: E402

pytestmark = [pytest.mark.llamafactory, pytest.mark.timeout(240)]

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


def check_odb_batches(batches: List[Tuple[int, int, int]], lengths: np.ndarray, epochs: int) -> None:
    rows = [b for b, _, _ in batches]
    assert sum(rows) == epochs * len(lengths), "every sample once per epoch"
    assert all(b * length <= BUDGET and length % 8 == 0 for b, length, _ in batches), batches
    assert len(set(rows)) > 2, f"batch sizes do not vary: {batches}"
    by_length = sorted(batches, key=lambda t: t[1])
    assert by_length[0][0] > by_length[-1][0], "short samples should get larger batches than long ones"
    odb_padding = 1.0 - sum(r for _, _, r in batches) / sum(b * length for b, length, _ in batches)
    fixed_padding, fixed_steps = fixed_batching_padding(lengths, BUDGET)
    assert odb_padding < fixed_padding, (odb_padding, fixed_padding)
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
    assert trainer.odb_config.gradient_accumulation_steps == 2
    result = trainer.train()

    assert math.isfinite(result.training_loss)
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert losses and all(math.isfinite(x) for x in losses)
    assert all("odb_mean_batch_size" in h for h in trainer.state.log_history if "loss" in h)
    assert not recorder.extra_keys, "odb's step info reached the model"  # it was popped from every batch
    assert trainer.odb_step_infos and all(isinstance(i, odb.ODBStepInfo) for i in trainer.odb_step_infos)
    check_odb_batches(recorder.batches, lengths, epochs=2)


def test_run_exp_runs_llamafactorys_sft_workflow_with_odb(setup):
    from llamafactory.train.sft import workflow

    original = workflow.CustomSeq2SeqTrainer
    recorder = BatchRecorder()
    args = sft_args(setup, "run_exp", num_train_epochs=1)
    odb_lf.run_exp(args, callbacks=[recorder], token_budget=BUDGET, buffer_size=16)

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
    assert (handle.config.pad_to_multiple_of, handle.config.gradient_accumulation_steps, handle.config.seed,
            handle.config.shift_labels) == (8, 2, 3, True)

    torch.manual_seed(0)
    model = LlamaForCausalLM(parts["model"].config).double()
    reference = LlamaForCausalLM(parts["model"].config).double()
    reference.load_state_dict(model.state_dict())
    step_ids: List[int] = []
    seen: List[int] = []
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
            step_ids = []
    assert sorted(seen) == list(range(len(dataset)))
    assert worst < 1e-5, worst  # transformers' causal-LM loss runs in float32 (logits.float()) even for a
    # float64 model; averaging the micro-batch means instead (scale 1/micro_steps) is off by ~10 here


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

    packed = SFTDataCollatorWith4DAttentionMask(template=parts["collator"].template, pad_to_multiple_of=8,
                                                neat_packing=True, attn_implementation="flash_attention_2",
                                                **parts["tokenizer_module"])
    loader = DataLoader(parts["dataset_module"]["train_dataset"], batch_size=1, collate_fn=packed)
    with pytest.raises(ValueError, match="neat_packing: false"):
        odb_lf.enable_odb(train_dataloader=loader, token_budget=BUDGET)
    neat = SFTDataCollatorWith4DAttentionMask(template=parts["collator"].template, pad_to_multiple_of=8,
                                              neat_packing=True, attn_implementation="sdpa",
                                              **parts["tokenizer_module"])
    loader = DataLoader(parts["dataset_module"]["train_dataset"], batch_size=1, collate_fn=neat)
    with pytest.warns(UserWarning, match=r"neat_packing=True: .*odb gains nothing.*Fix: set `neat_packing: false`"):
        odb_lf.enable_odb(train_dataloader=loader, token_budget=BUDGET)

    with pytest.raises(ValueError, match="stage='pt'"):
        odb_lf.run_exp(sft_args(setup, "pt", stage="pt"), token_budget=BUDGET)
