"""Image-less micro-batches under several ranks: what odb's dummy image costs against modality-aligned steps.

Plans ``odb.bench.vlm_data`` samples on ``world`` ranks (threads joined by
``odb.comm.threads.ThreadRanks``, the real exchange protocol), padded, and counts:

- **dummy**: one plan over all samples; each image-less micro-batch gets odb's dummy image
  (``odb.integrations.vlm``): how many, their vision patches against the real ones, and how
  many needed a column of their own;
- **aligned**: images and text-only samples planned apart, so every micro-batch holds one
  modality (what steps aligned by modality across ranks need at least): micro-batches per rank.

It also prints the VLM batching workload on one rank (``batching``): fixed batches of B
samples, transformers' ``LengthGroupedSampler`` in batches of B (``group_by_length``) and odb
padded, every arm under one memory cap (``token_budget`` padded tokens and
``max_image_patches`` vision patches per micro-batch; B is the largest that fits the longest
sample and the most patches): micro-batches and padding. Plans only, no training.

Run: ``python -m odb.bench.vlm_modalities`` (docs/vlm.md quotes its output).

Example:
    >>> row = compare("qwen2_vl", 24, token_budget=512, max_image_patches=512)  # doctest: +SKIP
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Sequence

import torch

import odb
import odb.comm.threads
from odb.bench import vlm_data as V
from odb.integrations.vlm import DummyImage, add_dummy_image, dummy_image_for


class _Items(torch.utils.data.Dataset):
    def __init__(self, items: Sequence[Dict[str, Any]]) -> None:
        self.items = list(items)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return self.items[i]


def plan_ranks(items: Sequence[Dict[str, Any]], dummy: DummyImage, world: int, token_budget: int,
               max_image_patches: int) -> List[Dict[str, int]]:
    """Per rank: micro-batches, real and padded tokens, image-less micro-batches and those that needed a column."""
    ranks = odb.comm.threads.ThreadRanks(world)
    data = _Items(items)
    out: List[Dict[str, int]] = [{} for _ in range(world)]

    def one(rank: int) -> None:
        counts = dict(batches=0, real=0, padded=0, imageless=0, extended=0)

        def collate(group: List[Dict[str, Any]]) -> Dict[str, Any]:
            batch = V.pad_collate(group)
            if "pixel_values" not in batch:
                width = batch["input_ids"].shape[1]
                batch = add_dummy_image(batch, dummy)
                counts["imageless"] += 1
                counts["extended"] += int(batch["input_ids"].shape[1] > width)
            return batch

        loader = odb.ODBDataLoader(data, token_budget=token_budget, sampler=odb.ShardSampler(data, world, rank, seed=0),
                                   collate_fn=collate, image_patches_key=V.PATCHES_KEY,
                                   max_image_patches=max_image_patches, exchange=ranks.exchanges(rank), seed=0,
                                   buffer_size=64)
        for batch in loader:
            info = odb.pop_step_info(batch)
            counts["batches"] += 1
            counts["real"] += info.real_tokens
            counts["padded"] += info.padded_tokens
        out[rank] = counts

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def compare(name: str, n: int, token_budget: int, max_image_patches: int, world: int = 2) -> Dict[str, Any]:
    """The dummy image's cost and the aligned plan's micro-batches for ``n`` samples of model ``name``."""
    samples = V.vlm_samples(name, n, seed=0)
    dummy = dummy_image_for(V.build_model(name))
    if dummy is None:
        raise ValueError(f"model {name!r} has no dummy image (odb.integrations.vlm.dummy_image_for): this comparison "
                         f"needs one. Fix: pass one of {V.MODELS}.")
    per_dummy = dummy.pixel_shape[0] if dummy.grid is not None else dummy.tokens
    mixed = plan_ranks(samples, dummy, world, token_budget, max_image_patches)
    images = [s for s in samples if s[V.PATCHES_KEY] > 0]
    text = [s for s in samples if s[V.PATCHES_KEY] == 0]
    apart = [plan_ranks(part, dummy, world, token_budget, max_image_patches) for part in (images, text)]
    imageless = sum(r["imageless"] for r in mixed)
    return {"model": name, "samples": n, "token_budget": token_budget, "max_image_patches": max_image_patches,
            "micro_batches": mixed[0]["batches"], "imageless": imageless,
            "all_micro_batches": world * mixed[0]["batches"],
            "dummy_patches": imageless * per_dummy, "real_patches": sum(s[V.PATCHES_KEY] for s in samples),
            "extended": sum(r["extended"] for r in mixed),
            "padding": 1 - sum(r["real"] for r in mixed) / sum(r["padded"] for r in mixed),
            "aligned_micro_batches": sum(p[0]["batches"] for p in apart),
            "aligned_padding": 1 - sum(r["real"] for p in apart for r in p) / sum(r["padded"] for p in apart
                                                                                  for r in p)}


def _cost(groups: Sequence[Sequence[int]], lengths: Sequence[int], patches: Sequence[int]) -> Dict[str, Any]:
    real = sum(lengths)
    padded = sum(len(g) * max(lengths[i] for i in g) for g in groups)
    return {"micro_batches": len(groups), "padding": 1 - real / padded,
            "max_patches": max(sum(patches[i] for i in g) for g in groups)}


def batching(name: str, n: int, token_budget: int, max_image_patches: int, seed: int = 0) -> Dict[str, Dict[str, Any]]:
    """Per arm (fixed, group_by_length, odb): micro-batches, padding share and the most patches in a micro-batch."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    samples = V.vlm_samples(name, n, seed=seed)
    lengths = [len(s["input_ids"]) for s in samples]
    patches = [int(s[V.PATCHES_KEY]) for s in samples]
    b = max(1, min(token_budget // max(lengths), max_image_patches // max(max(patches), 1)))
    g = torch.Generator().manual_seed(seed)
    shuffled = torch.randperm(n, generator=g).tolist()
    grouped = list(LengthGroupedSampler(b, lengths=lengths, generator=torch.Generator().manual_seed(seed)))
    out = {f"fixed (B={b})": _cost([shuffled[i:i + b] for i in range(0, n, b)], lengths, patches),
           f"group_by_length (B={b})": _cost([grouped[i:i + b] for i in range(0, n, b)], lengths, patches)}
    groups = []
    loader = odb.ODBDataLoader(_Items(samples), token_budget=token_budget, image_patches_key=V.PATCHES_KEY,
                               max_image_patches=max_image_patches, seed=seed, buffer_size=64,
                               collate_fn=V.pad_collate)
    for batch in loader:
        groups.append(list(odb.pop_step_info(batch).sample_ids))
    out["odb padded"] = _cost(groups, lengths, patches)
    return out


def main() -> None:
    for args in (("qwen2_vl", 480, 2048, 2048), ("llava", 480, 1024, 256)):
        arms = batching(*args)
        print(f"batching {args[0]}, {args[1]} samples, cap token_budget={args[2]}, max_image_patches={args[3]}: " +
              "; ".join(f"{arm}: {c['micro_batches']} micro-batches, padding {c['padding']:.3f}, at most "
                        f"{c['max_patches']} patches" for arm, c in arms.items()))
    for args in (("qwen2_vl", 96, 1024, 1024), ("qwen2_vl", 480, 512, 512), ("llava", 480, 512, 128)):
        r = compare(*args)
        print(f"{r['model']}, {r['samples']} samples, token_budget={r['token_budget']}, max_image_patches="
              f"{r['max_image_patches']}: dummy: {r['micro_batches']} micro-batches per rank, {r['imageless']} of "
              f"{r['all_micro_batches']} image-less, {r['dummy_patches']} dummy patches against {r['real_patches']:,} "
              f"({100 * r['dummy_patches'] / r['real_patches']:.2f}%), {r['extended']} with a column added, padding "
              f"{r['padding']:.3f}; aligned: {r['aligned_micro_batches']} micro-batches per rank "
              f"({100 * (r['aligned_micro_batches'] / r['micro_batches'] - 1):+.0f}%), padding "
              f"{r['aligned_padding']:.3f}")


if __name__ == "__main__":
    main()
