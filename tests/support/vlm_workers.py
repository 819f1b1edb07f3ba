"""Vision-language Trainer runs for tests/integrations/test_vlm_train.py (1 rank in the test process, 2 ranks
through dist_harness.run_ranks("vlm_workers:suite")).

Models and samples come from ``odb.bench.vlm_data`` (tiny Qwen2-VL and LLaVA from configs, real
processors), in float64. Each run records, per optimizer step, the gradient the optimizer sees
(all-reduced or gathered: the same on every rank, kept on rank 0) and the samples each rank trained;
and, per micro-batch the model saw, its rows x width, its image patches and whether it carries odb's
dummy image (all-zero pixels). ``reference_grads`` replays the steps in one process, each sample alone.
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict, List, Sequence

import torch

import hf_workers as W
from odb.bench import vlm_data as V

LR = 0.5


def dataset(p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """``p["n"]`` samples of ``p["model"]``; with ``split`` the image samples at even indices and the image-less
    ones at odd indices (sequential sharding then gives rank 0 every image and rank 1 none), rank 0's extra."""
    samples = V.vlm_samples(p["model"], p["n"], seed=p.get("data_seed", 0))
    if not p.get("split"):
        return samples
    images = [s for s in samples if s[V.PATCHES_KEY] > 0]
    text = [s for s in samples if s[V.PATCHES_KEY] == 0]
    k = min(len(images) - 1, len(text))
    out = [s for pair in zip(images[:k], text[:k]) for s in pair]
    return out + images[k:k + 1]


def model_for(p: Dict[str, Any]) -> torch.nn.Module:
    model = V.build_model(p["model"], seed=0, dtype=torch.float64)
    if p.get("freeze_vision"):  # LLaVA's usual recipe: the CLIP tower frozen, the projector trained
        model.model.vision_tower.requires_grad_(False)
    return model


def _flat_grads(model: torch.nn.Module) -> Dict[str, torch.Tensor]:
    out = {}
    for name, w in model.named_parameters():
        if w.grad is not None:
            g = w.grad
            out[name] = (g.full_tensor() if type(g).__name__ == "DTensor" else g).detach().clone()
    return out


def record_batches(trainer: Any, p: Dict[str, Any], seen: List[Dict[str, Any]]) -> None:
    """Make ``trainer`` (not yet odb-enabled) append to ``seen`` each micro-batch its model gets: rows, width,
    image patches, and whether it holds odb's dummy image (all-zero pixels)."""

    class Recording(type(trainer)):  # type: ignore[misc]
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
            pixels = inputs.get("pixel_values")
            patches = 0 if pixels is None else int(pixels.shape[0])  # Qwen2-VL: patches; LLaVA: images
            if p["model"] == "llava":
                patches *= (V.LLAVA_IMAGE // V.LLAVA_PATCH) ** 2
            seen.append({"rows": int(inputs["input_ids"].shape[0]), "width": int(inputs["input_ids"].shape[1]),
                         "patches": patches, "dummy": pixels is not None and not bool(pixels.ne(0).any())})
            return super().training_step(model, inputs, num_items_in_batch)

    trainer.__class__ = Recording


def train(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """One Trainer run per ``p``; this rank's record (see the module docstring)."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from odb.integrations.hf import enable_odb

    seen: List[Dict[str, Any]] = []
    steps: List[Dict[str, Any]] = []

    class Steps(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            infos = trainer.odb_step_infos
            grads = _flat_grads(trainer.model)
            steps.append({"ids": [i for info in infos if not info.is_ghost for i in info.sample_ids],
                          "ghosts": sum(info.is_ghost for info in infos),
                          "grads": grads if rank == 0 else None})

    model = p.get("loaded") or model_for(p)
    options = dict(output_dir=p["out"], use_cpu=True, report_to="none", disable_tqdm=True, optim="sgd",
                   learning_rate=LR, weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                   gradient_accumulation_steps=p.get("ga", 1), num_train_epochs=1, save_strategy="no",
                   logging_strategy="no", seed=7,
                   dataloader_num_workers=0, remove_unused_columns=False, gradient_checkpointing=p.get("gc", False),
                   train_sampling_strategy="sequential" if p.get("split") else "random")
    options.update(p.get("args", {}))
    trainer = Trainer(model=model, args=TrainingArguments(**options), train_dataset=dataset(p),
                      data_collator=V.pad_collate)
    record_batches(trainer, p, seen)
    enable_odb(trainer, token_budget=p["budget"], image_patches_key=V.PATCHES_KEY,
               max_image_patches=p["patch_cap"], buffer_size=16, global_batch_size=None, **p.get("odb", {}))
    trainer.add_callback(Steps())
    trainer.train()
    handler = getattr(trainer.accelerator, "ddp_handler", None)
    return {"steps": steps, "seen": seen, "find_unused": getattr(handler, "find_unused_parameters", None),
            "global_step": trainer.state.global_step}


def suite(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every run of ``p["runs"]`` in one set of processes (one interpreter start, one process group)."""
    if world > 1:
        W._join_torch_distributed(rank, world)
    out = []
    for k, run in enumerate(p["runs"]):
        start = time.perf_counter()
        run = dict(run, out=os.path.join(p["out"], str(k)))
        if run.get("fsdp"):
            from transformers.distributed import DistributedConfig

            cls = type(V.build_model(run["model"]))
            run["loaded"] = cls.from_pretrained(run["path"], distributed_config=DistributedConfig(fsdp_size=world),
                                                dtype=torch.float64)
        out.append(trl_train(rank, world, run) if run.get("trl") else train(rank, world, run))
        out[-1]["seconds"] = time.perf_counter() - start
    return out


def reference_grads(p: Dict[str, Any], steps: Sequence[Sequence[int]],
                    batches: Any = None) -> List[Dict[str, torch.Tensor]]:
    """Per step, in one process: the gradient of (sum of token losses) / (supervised tokens) over the step's
    samples, each sample alone (no padding, no other image; ``batches``: each sample's batch of one, else
    ``pad_collate`` of ``dataset(p)``); then an SGD step of rate ``LR``."""
    model = model_for(p)
    batches = batches if batches is not None else [V.pad_collate([s]) for s in dataset(p)]
    out = []
    for ids in steps:
        model.zero_grad(set_to_none=True)
        total, tokens = torch.zeros((), dtype=torch.float64), 0
        for i in ids:
            batch = batches[i]
            count = int((batch["labels"][:, 1:] != V.IGNORE).sum())
            total = total + model(**batch).loss * count
            tokens += count
        (total / tokens).backward()
        grads = {n: w.grad.detach().clone() for n, w in model.named_parameters() if w.grad is not None}
        out.append(grads)
        with torch.no_grad():
            for n, w in model.named_parameters():
                if n in grads:
                    w -= LR * grads[n]
    return out


def max_rel_error(got: Dict[str, torch.Tensor], ref: Dict[str, torch.Tensor]) -> float:
    """max |got - ref| / max |ref| over all parameters (a parameter without a gradient counts as zeros)."""
    names = set(got) | set(ref)
    zero = torch.zeros(())
    diff = max(float((got.get(n, zero) - ref.get(n, zero)).abs().max()) for n in names)
    return diff / max(float(g.abs().max()) for g in ref.values())


# ---- TRL's SFTTrainer on raw image chat samples ----------------------------------------------------


def raw_chats(n: int, seed: int = 0) -> List[Dict[str, Any]]:
    """TRL's vision dataset format: ``messages`` (a user turn, then the answer) and ``images`` (0-2 PIL noise
    images of random sizes; the user turn holds one image entry per image)."""
    import numpy as np

    rng = np.random.RandomState(seed)
    out = []
    for _ in range(n):
        count = int(rng.randint(0, 3))
        images = [V.noise_image(rng, int(rng.randint(12, 48)), int(rng.randint(12, 48))) for _ in range(count)]
        words = [" ".join(rng.choice(V.WORDS[5:], int(rng.randint(2, 16)))) for _ in range(2)]
        user = [{"type": "image"}] * count + [{"type": "text", "text": words[0]}]
        out.append({"messages": [{"role": "user", "content": user},
                                 {"role": "assistant", "content": [{"type": "text", "text": words[1]}]}],
                    "images": images})
    return out


def trl_train(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """TRL's SFTTrainer (its vision path: a processor and image samples) + enable_odb on the tiny Qwen2-VL."""
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from odb.integrations.trl import enable_odb

    steps: List[Dict[str, Any]] = []

    class Steps(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            infos = trainer.odb_step_infos
            grads = _flat_grads(trainer.model)  # all ranks: gathering a sharded gradient is a collective
            steps.append({"ids": [i for info in infos if not info.is_ghost for i in info.sample_ids],
                          "ghosts": sum(info.is_ghost for info in infos), "grads": grads if rank == 0 else None})

    args = SFTConfig(output_dir=p["out"], use_cpu=True, report_to="none", disable_tqdm=True, optim="sgd",
                     learning_rate=LR, weight_decay=0.0, max_grad_norm=0.0, lr_scheduler_type="constant",
                     gradient_accumulation_steps=p.get("ga", 1), num_train_epochs=1, save_strategy="no",
                     logging_strategy="no", seed=7, dataloader_num_workers=0,
                     gradient_checkpointing=p.get("gc", False), bf16=False)
    import datasets

    trainer = SFTTrainer(model=model_for(p), args=args, train_dataset=datasets.Dataset.from_list(raw_chats(p["n"])),
                         processing_class=V.build_processor(p["model"]))
    seen: List[Dict[str, Any]] = []
    record_batches(trainer, p, seen)
    enable_odb(trainer, token_budget=p["budget"], image_patches_key="image_patches", max_image_patches=p["patch_cap"],
               buffer_size=16, global_batch_size=None)
    trainer.add_callback(Steps())
    collator = type(trainer.data_collator).__name__
    trainer.train()
    return {"steps": steps, "collator": collator, "global_step": trainer.state.global_step, "seen": seen}


def trl_reference(p: Dict[str, Any], steps: Sequence[Sequence[int]]) -> List[Dict[str, torch.Tensor]]:
    """``reference_grads`` over TRL's collator output for each raw sample alone."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    collate = DataCollatorForVisionLanguageModeling(V.build_processor(p["model"]))
    import datasets

    data = [collate([dict(s)]) for s in datasets.Dataset.from_list(raw_chats(p["n"]))]
    return reference_grads(p, steps, data)
