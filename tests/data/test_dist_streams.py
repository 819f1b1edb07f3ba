"""Streams and persistent workers under real gloo ranks (tests/support/stream_workers.py through dist_harness).

An IterableDataset sharded by rank (uneven shards) and by DataLoader worker, num_workers=2 on
every rank: every sample once across ranks, every rank the same steps (ghosts on the short
ones), exact loss scaling checked against supervised tokens counted again from the collated
labels and from the lengths, and a mid-epoch resume on every rank that emits exactly what the
interrupted run had not. Persistent workers over several epochs resumed mid-epoch equal the
uninterrupted run. Marked ``dist``.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from dist_harness import run_ranks
from stream_workers import shards

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]
DEADLINE_S = 90.0


def _strip(records: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Records without the worker pids (a resumed loader has workers of its own)."""
    return [{k: v for k, v in r.items() if k != "pids"} for r in records]


def _resumed(out: Dict[str, Any]) -> List[Dict[str, Any]]:
    return _strip([r for e in out["before"] for r in e] + out["head"] + out["rest"] + [r for e in out["later"] for r in e])


def _optimizer_steps(records: List[Dict[str, Any]]) -> List[List[Dict[str, Any]]]:
    steps: List[List[Dict[str, Any]]] = []
    for r in records:
        if r["micro"][0] == 0:
            steps.append([])
        steps[-1].append(r)
    assert all(len(s) == s[0]["micro"][1] for s in steps), "an optimizer step lost a micro-batch"
    return steps


def check_epoch(per_rank: List[List[Dict[str, Any]]], sizes: List[int]) -> int:
    """One epoch of every rank: exactly once, equal steps, exact loss scaling; returns its ghost steps."""
    world = len(per_rank)
    assert len({len(r) for r in per_rank}) == 1, f"step counts differ: {[len(r) for r in per_rank]}"
    for records in per_rank:
        assert [r["step"] for r in records] == list(range(len(records)))
        assert len({pid for r in records for pid in r["pids"]}) == 2, "both workers of the rank read its shard"
    real = [i for records in per_rank for r in records if not r["ghost"] for i in r["idx"]]
    assert sorted(real) == list(range(sum(sizes))), "every sample exactly once across ranks"
    for rank, records in enumerate(per_rank):
        assert set(i for r in records for i in r["idx"]) <= set(shards(sizes)[rank]), "a rank read another's shard"
        for r in records:
            if r["ghost"]:
                assert (r["local"], r["scale"]) == (0, 0.0), r
            else:  # odb's count = the collated labels' = the lengths'
                assert r["local"] == r["counted"] == r["from_lengths"] > 0, r
    columns = list(zip(*[_optimizer_steps(records) for records in per_rank]))
    for column in columns:  # one optimizer step on every rank
        assert len({len(micro) for micro in column}) == 1
        total = sum(0 if r["ghost"] else r["counted"] for micro in column for r in micro)
        for micro in column:
            for r in micro:
                assert r["global"] == total, (r, total)
                assert r["scale"] == pytest.approx(world * r["local"] / total, rel=1e-12, abs=0.0), r
        assert sum(r["scale"] * total for micro in column for r in micro) == pytest.approx(world * total)
    return sum(r["ghost"] for records in per_rank for r in records)


@pytest.mark.parametrize("world, sizes, extra", [
    (2, [150, 90], {"refusals": True}),
    (3, [150, 90, 41], {"accumulation": 2, "stop": 7}),
    (2, [150, 90], {"stateful": True}),
], ids=["2-ranks-replayed", "3-ranks-accumulation", "2-ranks-own-state"])
def test_a_stream_sharded_by_rank_and_worker_runs_exactly_once_and_resumes_mid_epoch(tmp_path, world, sizes, extra):
    """The short ranks run ghost steps; the state saved after ``stop`` batches of epoch 0 on every rank
    resumes into fresh loaders that emit the rest and the next epoch as the uninterrupted run did. With
    its own state (as datasets.IterableDataset) the stream restarts from it: the ghost step after the
    resume used another sample than the interrupted run before the fix (its step info and loss scale
    were equal, its batch was not)."""
    params = {"sizes": sizes, "budget": 200, "epochs": 2, "stop_epoch": 0, "stop": 9, **extra}
    out = run_ranks("stream_workers:epochs_and_resume", world, params, tmp_path, deadline_s=DEADLINE_S)
    ghosts = [check_epoch([o["reference"][e] for o in out], sizes) for e in range(2)]
    assert min(ghosts) > 0, "uneven shards: the short ranks must run ghost steps"
    for rank, o in enumerate(out):
        assert _resumed(o) == _strip([r for e in o["reference"] for r in e]), f"rank {rank} resumed differently"
        assert 0 < o["arrived"] <= sizes[rank]
    if extra.get("refusals"):  # refused by design (docs/resume.md), each saying why and how
        for o in out:
            said = o["refusals"]
            assert "saved with num_workers=2, this loader has num_workers=1" in said["num_workers"], said
            assert "Fix: resume with num_workers=2" in said["num_workers"], said
            assert "only map-style data can be re-partitioned" in said["repartition"], said
            assert "Fix: resume with the saved world size" in said["repartition"], said
    assert max(o["elapsed"] for o in out) < 30.0


@pytest.mark.parametrize("worker, extra", [
    ("epochs_and_resume", {}),
    ("epochs_and_resume", {"map_style": True}),
    ("epochs_resumed_in_place", {"stateful": True}),
], ids=["stream", "map-style", "own-state-rewound-in-place"])
def test_persistent_workers_over_epochs_resumed_mid_epoch_equal_the_uninterrupted_run(tmp_path, worker, extra):
    """Three epochs with persistent workers (the same worker processes every epoch); the run is
    interrupted in the middle of epoch 1 and resumed: by a fresh loader, or by the same loader after it
    ran on (its persistent workers hold a copy of the stream). Same batches, same order, same step infos."""
    sizes = [150, 90]
    params = {"sizes": sizes, "budget": 200, "epochs": 3, "stop_epoch": 1, "stop": 9, "persistent": True, **extra}
    out = run_ranks(f"stream_workers:{worker}", 2, params, tmp_path, deadline_s=DEADLINE_S)
    for rank, o in enumerate(out):
        per_epoch = [{pid for r in epoch for pid in r["pids"]} for epoch in o["reference"]]
        assert len(per_epoch[0]) == 2 and per_epoch == [per_epoch[0]] * 3, f"rank {rank}: workers did not persist"
        reference = _strip([r for e in o["reference"] for r in e])
        if worker == "epochs_and_resume":
            assert _resumed(o) == reference, f"rank {rank} resumed differently"
        else:
            done = sum(len(e) for e in o["reference"][:params["stop_epoch"]])
            got = _strip(o["head"] + o["rest"] + [r for e in o["later"] for r in e])
            assert got == reference[done:], f"rank {rank} resumed differently"
    if not extra.get("map_style"):
        for e in range(3):
            check_epoch([o["reference"][e] for o in out], sizes)
