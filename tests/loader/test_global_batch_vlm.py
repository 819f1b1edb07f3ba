"""Vision-language samples in a step planned across ranks: with online lengths the processed samples move
between ranks with their images (pixel_values, image_grid_thw), image patches are priced in the plan, and
the updates equal the plain loop's. Real Qwen2-VL samples from its processor (odb.bench.vlm_data), ranks
as threads (odb.comm.threads)."""

from __future__ import annotations

from typing import Any, Dict, List, Tuple

import pytest
import torch
from torch.utils.data import DataLoader

import odb
from odb.bench.vlm_data import IGNORE, PATCHES_KEY, build_model, pad_collate, vlm_samples
from test_thread_ranks import ok, run_ranks

N = 24
# Qwen2-VL computes its rotary angles in float32, whose cos/sin differ by an ulp with the batch's padded shape,
# so a float64 model matches the plain loop to about 1e-9 relative, not to rounding (measured 1.3e-9)
ROPE_FLOAT32 = 1e-7
BUDGET = 640
PATCH_COST = 0.5  # each image patch costs half a token in the plan
MAX_PATCHES = 1024  # and a micro-batch holds at most this many
SAMPLES = vlm_samples("qwen2_vl", N, seed=0)


class Samples(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> Dict[str, Any]:
        return SAMPLES[i]


def sampler_of(rank: int, world: int) -> odb.ShardSampler:
    return odb.ShardSampler(Samples(), num_replicas=world, rank=rank, shuffle=True, seed=5)


def odb_batches(world: int, global_batch: int) -> List[List[Tuple[Dict[str, Any], odb.ODBStepInfo]]]:
    def one(rank: int, exchanges: Any) -> List[Tuple[Dict[str, Any], odb.ODBStepInfo]]:
        loader = odb.ODBDataLoader(Samples(), token_budget=BUDGET, global_batch_size=global_batch,
                                   sampler=sampler_of(rank, world), collate_fn=pad_collate, seed=0,
                                   image_patches_key=PATCHES_KEY, image_patch_cost=PATCH_COST,
                                   max_image_patches=MAX_PATCHES, shift_labels=True,
                                   exchange=exchanges)
        return [(b, odb.pop_step_info(b)) for b in loader]

    return ok(run_ranks(world, one))


def steps_of(batches: List[Tuple[Dict[str, Any], odb.ODBStepInfo]]) -> List[List[Tuple[Dict[str, Any], Any]]]:
    out: List[List[Tuple[Dict[str, Any], Any]]] = [[]]
    for batch, info in batches:
        out[-1].append((batch, info))
        if info.is_last_micro_step:
            out.append([])
    return out[:-1]


@pytest.mark.parametrize("world,global_batch", [(2, 12), (3, 12)])
def test_samples_move_with_their_images_and_every_step_holds_the_plain_loops(world: int, global_batch: int) -> None:
    got = odb_batches(world, global_batch)
    share = global_batch // world
    orders = [list(sampler_of(r, world)) for r in range(world)]
    steps = [steps_of(rank) for rank in got]
    assert len({len(s) for s in steps}) == 1
    moved = 0
    for k in range(len(steps[0])):
        ids = sorted(i for r in range(world) for _, info in steps[r][k] for i in info.sample_ids)
        assert ids == sorted(i for o in orders for i in o[k * share:(k + 1) * share])  # the plain loop's step
        for r in range(world):
            for batch, info in steps[r][k]:
                if info.is_ghost:
                    continue
                members = [SAMPLES[i] for i in info.sample_ids]
                moved += sum(i not in orders[r][k * share:(k + 1) * share] for i in info.sample_ids)
                want = pad_collate(members)  # the images arrive intact, in the batch's sample order
                assert set(want) == set(batch) and all(torch.equal(want[key], batch[key]) for key in want)
                patches = sum(s[PATCHES_KEY] for s in members)
                width = max(len(s["input_ids"]) for s in members)
                assert len(members) * width + PATCH_COST * patches <= BUDGET  # the patches are priced
                assert patches <= MAX_PATCHES
    assert moved > 0, "no sample crossed ranks: this test would not show samples moving with their images"


def test_updates_equal_the_plain_loops_on_two_ranks() -> None:
    world, global_batch = 2, 8
    got = odb_batches(world, global_batch)
    torch.manual_seed(0)
    model = build_model("qwen2_vl", seed=0, dtype=torch.float64)
    ref = build_model("qwen2_vl", seed=0, dtype=torch.float64)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    steps = [steps_of(rank) for rank in got]
    orders = [list(sampler_of(r, world)) for r in range(world)]
    share = global_batch // world
    for k in range(min(3, len(steps[0]))):
        opt.zero_grad()
        for r in range(world):
            for batch, info in steps[r][k]:
                if not info.is_ghost:
                    (model(**batch).loss * info.loss_scale / world).backward()
        opt.step()
        # the plain loop: each rank's DataLoader(batch_size=share) batch, the loss the step's token mean
        ref_opt.zero_grad()
        plain = [next(iter(DataLoader([SAMPLES[i] for i in o[k * share:(k + 1) * share]], batch_size=share,
                                      collate_fn=pad_collate))) for o in orders]
        total = sum(int((b["labels"][:, 1:] != IGNORE).sum()) for b in plain)
        for b in plain:
            n = int((b["labels"][:, 1:] != IGNORE).sum())
            (ref(**b).loss * n / total).backward()
        ref_opt.step()
    with torch.no_grad():
        num = max(float((p - q).abs().max()) for p, q in zip(model.parameters(), ref.parameters()))
        den = max(float(q.abs().max()) for q in ref.parameters())
    assert num / den < ROPE_FLOAT32
