"""The scale section's meshes and collectives (odb.bench.scale_mesh): the collectives it prices are the ones odb's
loaders run (counted through thread ranks), the ring model's arithmetic, and a mesh step within the per-GPU cap.
"""

from __future__ import annotations

import numpy as np
import pytest

import odb
from helpers import Counting, LengthDataset, known_lengths, on_threads, pad_collate
from odb.bench import scale_mesh
from odb.comm.threads import ThreadRanks

LENGTHS = known_lengths(96, 1, 60, seed=6)
SHARE = 8


def counted(rank: int, ex, known: bool):
    counting = Counting(ex)
    data = LengthDataset(LENGTHS)
    loader = odb.ODBDataLoader(data, token_budget=120, global_batch_size=2 * SHARE, shift_labels=False,
                               sampler=odb.ShardSampler(data, num_replicas=2, rank=rank, seed=1),
                               collate_fn=pad_collate, exchange=counting, lengths=LENGTHS if known else None)
    infos = [odb.pop_step_info(b) for b in loader]
    return {"gathers": counting.counts, "micro": [i.micro_steps for i in infos if i.micro_step == 0]}


@pytest.mark.parametrize("mode", ["known", "online"])
def test_the_priced_collectives_are_the_loaders(mode):
    got = on_threads(ThreadRanks(2), lambda r, ex: counted(r, ex, mode == "known"))[0]
    steps = len(got["micro"])
    expected = 0.0
    for micro in got["micro"]:
        cols = scale_mesh.step_collectives(mode, world=2, share=SHARE, dims=1, micro_steps=micro)
        expected += sum(c.per_step for c in cols if "per epoch" not in c.name)
    if mode == "known":
        expected += 1  # the epoch's header
        assert got["gathers"] == [1, steps]  # (the run's exchange: the header; the step exchange: one per step)
    assert sum(got["gathers"]) == expected, (got, expected)


def test_ring_model_and_goals():
    link = scale_mesh.Link(10e-6, 1e9)
    assert scale_mesh.ring_seconds(5, 1000, link) == pytest.approx(4 * (10e-6 + 1e-6))
    assert scale_mesh.ring_seconds(1, 1000, link) == 0.0
    rows = scale_mesh.collective_rows(worlds=(8, 1024))
    known = [r for r in rows if r["mode"] == "known"]
    assert all(r["gloo"]["batch_s"] < 1e-3 for r in known)  # (one header per epoch)
    goals = scale_mesh.mesh_goals([{"gpus": 8, "cp": 2, "ratio": 0.97}], rows)
    assert [g["met"] for g in goals] == [True, True, True]


def test_a_mesh_step_keeps_every_gpu_within_the_cap():
    lengths = np.array(known_lengths(64, 8, 700, seed=2), dtype=np.int64)
    for cp in (1, 2, 4):
        step = scale_mesh.mesh_step(lengths, replicas=4, cp=cp, cap=1024, overhead=64)
        assert sum(m.real for rank in step for m in rank if m is not None) == pytest.approx(lengths.sum() / cp)
        assert max(m.padded for rank in step for m in rank if m is not None) <= 1024  # per GPU
