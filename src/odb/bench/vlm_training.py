"""VLM training speed: a tiny Qwen2-VL (and LLaVA) trained on image-bearing chat samples, odb against what users pick.

The workload (``vlm_data``): chat samples processed alone by the model's real processor
(chat template, image-token expansion, prompt masked), about half with 1-2 noise images
whose sides are drawn from ``SIDES`` pixels, so a Qwen2-VL image is 1 to ``(SIDES[1] / 8)^2``
expanded tokens (patch 4, 2 x 2 merge) and its vision tower runs on 4x as many patches;
LLaVA resizes every image to one size (16 tokens each): its lengths vary with the text
and the number of images only, the workload where odb has least to gain.

One process on CPU (one thread), ``rounds`` interleaved rounds (the arms' order rotated,
the data order and initial weights seeded by the round), each arm one epoch from the same
weights with AdamW. Every arm trains the same samples per optimizer step, G = B x A, and a
step's loss is its token mean over its micro-batches (HF's ``num_items_in_batch`` rule). One
memory cap for all arms: ``cap`` padded tokens per micro-batch, B the largest micro-batch
whose worst case (B x the longest sample) fits it (as ``training_arms.fixed_batch_size``),
and ``B x the most patches of one sample`` vision patches per micro-batch (what the fixed
arm's worst micro-batch may carry, so the memory a user provisions for fixed B):

- ``fixed``: ``DataLoader(batch_size=B, shuffle=True)``, A micro-batches per step;
- ``group_by_length``: transformers' ``LengthGroupedSampler(B x A)`` over ``input_ids``
  lengths (image tokens expanded: what ``Trainer(group_by_length=True)`` groups by) in
  batches of B, A per step;
- ``odb_padded``: ``ODBDataLoader(token_budget=cap, global_batch_size=G, max_image_patches=
  patch cap, image_patches_key=...)``, the user's padding collator; ``shift_labels=True``
  (a causal LM's label count; no speed effect);
- ``odb_packed``: the same with ``layout="packed"`` and ``PackedCollate.for_model(model)``
  (the model's own 3-D rope positions per sample), trained with ``odb_varlen`` attention
  (the one exception to sdpa: a packed row needs a varlen kernel);
- ``odb_gbl_padded`` / ``odb_gbl_packed``: odb with group_by_length's ``LengthGroupedSampler`` (the same seed)
  as its sampler: group_by_length's steps, cut into micro-batches by odb;
- ``odb_length_grouped``: odb padded with ``composition="length_grouped"`` (steps of length-similar samples,
  their order shuffled: odb's own composition).

TRL's ``SFTTrainer`` is no separate arm: TRL 1.16 refuses packing and padding-free rows for
vision datasets, so its VLM path trains padded batches of the Trainer's sampler: the
``fixed`` (default) and ``group_by_length`` arms here, plus the Trainer's own loop.

Per arm (median and min-max over rounds): real tokens/s (non-pad tokens, image tokens
included, over the epoch's wall time, loading included), vision patches/s (image patches
through the vision tower per second), optimizer steps, micro-steps, padding share, samples
per step, and the largest micro-batch against the caps (tokens and patches).

Example:
    >>> out = run_vlm_training(quick=True)  # doctest: +SKIP
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

import odb

from odb.bench import vlm_data as V
from odb.bench.convergence import _chunks, _label_tokens, spread
from odb.bench.training_arms import PACKED_ATTN, fixed_batch_size
from odb.bench.training_run import _counts
from odb.data.vision_fields import image_patches

ARMS = ("fixed", "group_by_length", "odb_padded", "odb_packed", "odb_gbl_padded", "odb_gbl_packed",
        "odb_length_grouped")
ODB_ARMS = ("odb_padded", "odb_packed", "odb_gbl_padded", "odb_gbl_packed", "odb_length_grouped")
PACKED = ("odb_packed", "odb_gbl_packed")
ATTENTION = {a: PACKED_ATTN for a in PACKED}  # others: sdpa over padded batches
LABELS = {"fixed": "fixed", "group_by_length": "group_by_length", "odb_padded": "odb padded",
          "odb_packed": "odb packed", "odb_gbl_padded": "odb padded on group_by_length's steps",
          "odb_gbl_packed": "odb packed on group_by_length's steps", "odb_length_grouped": "odb length_grouped"}
SIDES = (16, 160)  # image sides in pixels (Qwen2-VL: 1 to 400 expanded tokens per image)
MODEL = {"hidden": 64, "layers": 2}  # the text decoder of build_model; its vision towers stay tiny
LR = 1e-3
# (workload name, model, cap in padded tokens per micro-batch, samples, accumulation A) per size
SIZES: Dict[str, Dict[str, Any]] = {
    "full": {"workloads": [("qwen2_vl", 2048, 480, 4), ("llava", 512, 480, 4)], "rounds": 3},
    "quick": {"workloads": [("qwen2_vl", 1024, 16, 2), ("llava", 256, 16, 2)], "rounds": 1},
}
Step = List[Dict[str, Any]]  # a step's micro-batches: {"batch", "scale" (None: the step's token mean)}


def batch_patches(batch: Dict[str, Any]) -> int:
    """Image patches the vision tower runs on in ``batch`` (Qwen2-VL: its grids; LLaVA: images x patches each).

    Example:
        >>> batch_patches({"image_grid_thw": torch.tensor([[1, 4, 6], [1, 2, 2]])}), batch_patches({})
        (28, 0)
    """
    return image_patches(batch, patches_per_image=(V.LLAVA_IMAGE // V.LLAVA_PATCH) ** 2)


def caps(samples: Sequence[Dict[str, Any]], cap: int) -> Dict[str, int]:
    """The memory cap: B (the largest micro-batch whose longest sample fits ``cap``) and the patch cap (B x the
    most patches of one sample: what fixed's worst micro-batch may carry)."""
    lengths = [len(s["input_ids"]) for s in samples]
    b = fixed_batch_size(cap, lengths)
    return {"batch_size": b, "token_budget": cap,
            "max_image_patches": b * max(1, max(int(s[V.PATCHES_KEY]) for s in samples))}


def _steps(arm: str, samples: List[Dict[str, Any]], model: torch.nn.Module, c: Dict[str, int], acc: int,
           seed: int) -> Iterator[Step]:
    """The optimizer steps of one epoch of ``arm``: each a list of micro-batches."""
    b = c["batch_size"]
    g = torch.Generator().manual_seed(seed)
    lengths = [len(s["input_ids"]) for s in samples]
    if arm in ("fixed", "group_by_length"):
        if arm == "fixed":
            loader: Any = DataLoader(samples, batch_size=b, shuffle=True, generator=g, collate_fn=V.pad_collate)
        else:
            from transformers.trainer_pt_utils import LengthGroupedSampler

            order = list(LengthGroupedSampler(b * acc, lengths=lengths, generator=g))
            loader = DataLoader(samples, batch_sampler=_chunks(order, b), collate_fn=V.pad_collate)
        step: Step = []
        for batch in loader:
            step.append({"batch": batch, "scale": None, "samples": int(batch["input_ids"].shape[0])})
            if len(step) == acc:
                yield step
                step = []
        if step:
            yield step
        return
    options: Dict[str, Any] = {"token_budget": c["token_budget"], "global_batch_size": b * acc, "shuffle": True,
                               "seed": seed, "shift_labels": True, "image_patches_key": V.PATCHES_KEY,
                               "max_image_patches": c["max_image_patches"]}
    if arm.startswith("odb_gbl"):  # group_by_length's own order (the same generator seed): its steps, cut by odb
        from transformers.trainer_pt_utils import LengthGroupedSampler

        del options["shuffle"]
        options["sampler"] = LengthGroupedSampler(b * acc, lengths=lengths,
                                                  generator=torch.Generator().manual_seed(seed))
    if arm == "odb_length_grouped":
        options["composition"] = "length_grouped"
    if arm in PACKED:
        options.update(layout="packed", collate_fn=odb.PackedCollate.for_model(model))
    else:
        options["collate_fn"] = V.pad_collate
    step = []
    for batch in odb.ODBDataLoader(samples, **options):
        info = odb.pop_step_info(batch)
        step.append({"batch": batch, "scale": info.loss_scale, "samples": info.local_samples})
        if info.is_last_micro_step:
            yield step
            step = []
    if step:
        yield step


def train_epoch(arm: str, name: str, samples: List[Dict[str, Any]], c: Dict[str, int], acc: int,
                seed: int) -> Dict[str, Any]:
    """One epoch of ``arm`` from weights seeded by ``seed``: wall seconds, tokens, patches, steps."""
    if arm in ATTENTION:
        odb.register_varlen_attention()
    model = V.build_model(name, seed=seed, attn_implementation=ATTENTION.get(arm, "sdpa"), **MODEL)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    out = {"steps": 0, "micro_steps": 0, "real": 0, "padded": 0, "patches": 0, "max_tokens": 0, "max_patches": 0,
           "samples_per_step": []}
    t0 = time.perf_counter()
    for step in _steps(arm, samples, model, c, acc, seed):
        total = sum(_label_tokens(m["batch"]) for m in step)
        for m in step:
            scale = m["scale"] if m["scale"] is not None else _label_tokens(m["batch"]) / max(1, total)
            (model(**m["batch"]).loss * scale).backward()
            real, padded = _counts(m["batch"])
            patches = batch_patches(m["batch"])
            out["real"] += real
            out["padded"] += padded
            out["patches"] += patches
            out["max_tokens"] = max(out["max_tokens"], padded)
            out["max_patches"] = max(out["max_patches"], patches)
        opt.step()
        opt.zero_grad(set_to_none=True)
        out["steps"] += 1
        out["micro_steps"] += len(step)
        out["samples_per_step"].append(sum(m["samples"] for m in step))
    out["wall_s"] = time.perf_counter() - t0
    return out


def _warm_up(name: str, samples: List[Dict[str, Any]]) -> None:
    """First-call costs (allocator growth, kernel choice) land on no arm."""
    odb.register_varlen_attention()
    for attn in ("sdpa", PACKED_ATTN):
        model = V.build_model(name, seed=99, attn_implementation=attn, **MODEL)
        collate = V.pad_collate if attn == "sdpa" else odb.PackedCollate.for_model(model)
        for _ in range(2):
            model(**collate(samples[:4])).loss.backward()


def run_workload(name: str, cap: int, n: int, acc: int, rounds: int,
                 log: Callable[[str], None] = lambda m: None) -> Dict[str, Any]:
    """Every arm, ``rounds`` interleaved rounds, on ``n`` samples of model ``name``: medians and spreads."""
    samples = V.vlm_samples(name, n, seed=0, sides=SIDES)
    c = caps(samples, cap)
    lengths = np.array([len(s["input_ids"]) for s in samples])
    patches = np.array([int(s[V.PATCHES_KEY]) for s in samples])
    _warm_up(name, samples)
    runs: Dict[str, List[Dict[str, Any]]] = {a: [] for a in ARMS}
    for r in range(rounds):
        for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
            e = train_epoch(arm, name, samples, c, acc, seed=r)
            runs[arm].append(e)
            log(f"[vlm] {name} round {r + 1}/{rounds} {arm}: {e['steps']} steps, {e['micro_steps']} micro-steps, "
                f"{e['wall_s']:.2f} s, {e['real'] / e['wall_s']:.0f} tokens/s")
    g = c["batch_size"] * acc
    with_images = patches > 0
    out: Dict[str, Any] = {
        "model": name, "samples": n, "accumulation": acc, "global_batch_size": g, **c,
        "mean_length": float(lengths.mean()), "max_length": int(lengths.max()), "tokens": int(lengths.sum()),
        "image_share": float(with_images.mean()), "patches": int(patches.sum()),
        "patches_per_image_sample": {"min": int(patches[with_images].min()), "max": int(patches[with_images].max())}
        if with_images.any() else None,
        "arms": {}}
    for arm, rs in runs.items():
        per_step = [s for e in rs for s in e["samples_per_step"]]
        rates = [e["real"] / e["wall_s"] for e in rs]
        out["arms"][arm] = {
            "tokens_per_s": spread(rates),
            "tokens_per_s_rounds": rates,  # round by round (the arms paired by round)
            "patches_per_s": spread([e["patches"] / e["wall_s"] for e in rs]),
            "wall_s": spread([e["wall_s"] for e in rs]),
            "steps": int(statistics.median(e["steps"] for e in rs)),
            "micro_steps": int(statistics.median(e["micro_steps"] for e in rs)),
            "padding_share": statistics.median(1 - e["real"] / e["padded"] for e in rs),
            "samples_per_step": {"min": min(per_step), "max": max(per_step),
                                 "all_but_last_equal_g": all(s == g for e in rs for s in e["samples_per_step"][:-1])},
            "samples": [sum(e["samples_per_step"]) for e in rs],
            "real_tokens": [e["real"] for e in rs], "vision_patches": [e["patches"] for e in rs],
            "max_micro_batch_tokens": max(e["max_tokens"] for e in rs),
            "max_micro_batch_patches": max(e["max_patches"] for e in rs),
            "attention": ATTENTION.get(arm, "sdpa")}
    med = {a: m["tokens_per_s"]["median"] for a, m in out["arms"].items()}
    out["odb_over"] = {o: {a: med[o] / med[a] for a in med if a != o} for o in ODB_ARMS}
    return out


def settings(b: int, acc: int) -> Dict[str, str]:
    """Each arm's settings in words, for the tables."""
    return {"fixed": f"DataLoader(batch_size={b}, shuffle=True), {acc} micro-batches per step",
            "group_by_length": f"LengthGroupedSampler({b}x{acc}) over input_ids lengths, batches of {b}, {acc} per step",
            "odb_padded": f"ODBDataLoader(token_budget=cap, global_batch_size={b * acc}, max_image_patches=patch cap, "
                          "image_patches_key, shift_labels=True), the user's padding collator",
            "odb_packed": "the same with layout='packed', PackedCollate.for_model(model), odb_varlen attention",
            "odb_gbl_padded": f"odb padded with group_by_length's LengthGroupedSampler({b}x{acc}) as its sampler: "
                              "group_by_length's steps, cut into micro-batches",
            "odb_gbl_packed": "the same, packed",
            "odb_length_grouped": "odb padded with composition='length_grouped' (length-similar steps, shuffled)"}


def worst(workloads: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """Per odb arm, its lowest ratio of real tokens/s over a baseline (fixed, group_by_length), across workloads.

    Example:
        >>> w = {"a": {"odb_over": {"odb_padded": {"fixed": 1.2, "group_by_length": 0.9},
        ...                         "odb_packed": {"fixed": 1.6, "group_by_length": 1.3}}}}
        >>> worst(w)["odb_padded"]
        {'ratio': 0.9, 'workload': 'a', 'baseline': 'group_by_length'}
    """
    out = {}
    for o in [a for a in ODB_ARMS if all(a in w["odb_over"] for w in workloads.values())]:
        ratio, name, base = min((w["odb_over"][o][base], name, base) for name, w in workloads.items()
                                for base in ("fixed", "group_by_length"))
        out[o] = {"ratio": ratio, "workload": name, "baseline": base}
    return out


def run_vlm_training(*, quick: bool = False, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)
                     ) -> Dict[str, Any]:
    """The VLM section of ``python -m odb.bench``: every workload of ``SIZES``, one torch thread."""
    size = SIZES["quick" if quick else "full"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        workloads = {}
        for name, cap, n, acc in size["workloads"]:
            w = run_workload(name, cap, n, acc, size["rounds"], log=log)
            w["settings"] = settings(w["batch_size"], acc)
            workloads[name] = w
    finally:
        torch.set_num_threads(threads)
    return {"rounds": size["rounds"], "threads": 1, "sides": list(SIDES), "model": dict(MODEL), "lr": LR,
            "arms": list(ARMS), "workloads": workloads, "worst": worst(workloads)}
