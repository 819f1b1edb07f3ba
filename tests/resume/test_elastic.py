"""Elastic resume (an epoch saved by W ranks continues on W' ranks), the state's round trips
(JSON and torch.save / torch.load(weights_only=True)), and IterableDatasets resumed through
their own state_dict() instead of a replay of the stream.

The elastic tests run real gloo processes (dist_harness): each phase is a fresh set of
processes that loads what the previous phase saved on disk, as after a restart.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any, Dict, List, Optional

import pytest

import elastic_workers as ew
import odb
from dist_harness import run_ranks
from helpers import LengthDataset, StreamDataset, known_lengths, pad_collate
from roundtrip import json_copy, read, round_trip, same, torch_copy
from odb.resume.elastic import remaining, repartition
from odb.epoch.run_state import fresh_run_state, retained_positions

N = 301  # odd: DistributedSampler pads the last rank with a repeated index


# ---- helpers ---------------------------------------------------------------------------------------


def global_epoch(p: Dict[str, Any], world: int, epoch: int) -> Counter:
    """Every index the W ranks' samplers yield in ``epoch`` (with DistributedSampler's repeats)."""
    ds = LengthDataset(ew.elastic_lengths(p))
    out: Counter = Counter()
    for rank in range(world):
        sampler = ew.elastic_sampler(p, ds, world, rank)
        sampler.set_epoch(epoch)
        out.update(int(i) for i in sampler)
    return out


def emitted(steps: List[Dict[str, Any]]) -> Counter:
    return Counter(i for s in steps for i in s["ids"] if not s["ghost"])


def check_phase(results: List[Dict[str, Any]], world: int, first_step: int, budget: int) -> None:
    """Equal steps on every rank, step indices continuing from ``first_step``, exact loss scales."""
    per_rank = [r["steps"] for r in results]
    assert len({len(s) for s in per_rank}) == 1, f"step counts differ: {[len(s) for s in per_rank]}"
    for k, column in enumerate(zip(*per_rank)):
        assert [c["step"] for c in column] == [first_step + k] * world
        assert sum(c["scale"] for c in column) == pytest.approx(world)
        for c in column:
            assert c["ids"] == ([] if c["ghost"] else c["idx"])  # the step info names dataset indices
            assert c["padded"] <= budget


def plain(obj: Any, where: str = "state") -> None:
    """Only what JSON and torch.load(weights_only=True) both carry: dicts with str keys, lists, scalars."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str), f"{where} has key {k!r}"
            plain(v, f"{where}[{k!r}]")
    elif isinstance(obj, list):
        for k, v in enumerate(obj):
            plain(v, f"{where}[{k}]")
    else:
        assert obj is None or type(obj) in (int, float, str, bool), f"{where} is {type(obj).__name__}"


# ---- elastic resume with real ranks -------------------------------------------------------------


@pytest.mark.dist
@pytest.mark.timeout(240)
def test_two_ranks_resume_on_three_then_on_two_again(tmp_path):
    """2 -> 3 -> 2 ranks within one epoch (DistributedSampler with its padding), workers 0 -> 2 -> 0,
    states through JSON, then torch.save: every sample of the epoch once, none twice."""
    p = dict(n=N, budget=200, buffer=32, sampler="distributed", epoch=1)
    first = run_ranks("elastic_workers:elastic_phase", 2, dict(p, num_workers=0, stop=4, save_to=str(tmp_path / "a"),
                                                               format="json"), tmp_path / "run1")
    second = run_ranks("elastic_workers:elastic_phase", 3, dict(p, num_workers=2, stop=3, load_from=str(tmp_path / "a"),
                                                                save_to=str(tmp_path / "b"), format="pt"),
                       tmp_path / "run2", deadline_s=120)
    third = run_ranks("elastic_workers:elastic_phase", 2, dict(p, num_workers=0, load_from=str(tmp_path / "b")),
                      tmp_path / "run3")
    check_phase(first, 2, 0, p["budget"])
    check_phase(second, 3, 4, p["budget"])
    check_phase(third, 2, 7, p["budget"])
    got = sum((emitted(r["steps"]) for r in first + second + third), Counter())
    want = global_epoch(p, 2, epoch=1)
    assert sum(want.values()) == N + 1 and max(want.values()) == 2  # the padding repeats one index
    assert got == want, f"lost {want - got}, repeated {got - want}"
    for r in third:  # the next epoch is the 2-rank sampler's own again
        assert emitted(r["next"]) == Counter(r["expected_next"])
    assert sum((emitted(r["next"]) for r in third), Counter()) == global_epoch(p, 2, epoch=2)


@pytest.mark.dist
@pytest.mark.timeout(240)
@pytest.mark.parametrize("old, new, known, accumulation", [(3, 2, False, 2), (2, 1, True, 1)],
                         ids=["3-to-2-accumulation2", "2-to-1-known-lengths"])
def test_resume_on_fewer_ranks(tmp_path, old, new, known, accumulation):
    p = dict(n=N, budget=200, buffer=32, sampler="shard", epoch=0, known=known, accumulation=accumulation)
    first = run_ranks("elastic_workers:elastic_phase", old, dict(p, num_workers=1, stop=4, save_to=str(tmp_path / "a"),
                                                                 format="pt"), tmp_path / "run1")
    after = dict(p, num_workers=0, load_from=str(tmp_path / "a"))
    if new == 1:  # one process needs no process group: run it here
        second = [ew.elastic_phase(0, 1, after)]
    else:
        second = run_ranks("elastic_workers:elastic_phase", new, after, tmp_path / "run2")
    if accumulation == 1:
        check_phase(first, old, 0, p["budget"])
        check_phase(second, new, 4, p["budget"])
    else:  # loss scales sum to the world size per optimizer step, not per micro-batch
        for results, world in ((first, old), (second, new)):
            per_rank = [r["steps"] for r in results]
            assert len({len(s) for s in per_rank}) == 1
            for k in range(0, len(per_rank[0]), accumulation):
                window = [c for r in per_rank for c in r[k:k + accumulation]]
                assert sum(c["scale"] for c in window) == pytest.approx(world)
        assert second[0]["steps"][0]["micro"][0] == 0  # a new optimizer step
    got = sum((emitted(r["steps"]) for r in first + second), Counter())
    assert got == Counter(range(N)), "every sample of the epoch exactly once"
    assert sum((emitted(r["next"]) for r in second), Counter()) == Counter(range(N))


@pytest.mark.dist
@pytest.mark.timeout(180)
def test_datasets_iterable_split_by_rank_resumes_through_its_own_state(tmp_path):
    # Lengths 40-60 pack well, so nothing stays carried from the first windows and the stream can
    # restart well past its start; the ghost sample is kept among the held ones, not the first read.
    p = dict(n=241, shards=4, low=40, budget=200, buffer=32, num_workers=0, stop_before_end=12)
    results = run_ranks("elastic_workers:stream_resume_ranks", 2, p, tmp_path, deadline_s=120)
    for rank, r in enumerate(results):
        assert r["resumed"] == r["reference"], f"rank {rank}: the resumed epoch differs"
        run = r["state"]["run"]
        start, held = run["position"]["stream"]["start"], min(retained_positions(run))
        assert 0 < start <= held < start + 16 and run["position"]["ghost"] >= held, (start, held, run["position"]["ghost"])
    assert sorted(i for r in results for s in r["reference"] for i in s["idx"] if not s["ghost"]) == list(range(241))


# ---- the re-partition itself (pure) ---------------------------------------------------------------


def test_remaining_positions_and_new_shares_cover_what_no_rank_emitted():
    # Two ranks over 11 positions: rank 0 read its first 3 (0, 2, 4), still holds 2; rank 1 read 2 (1, 3), holds none.
    layer = {"world": 2, "arrived": [3, 2], "kept": [2], "total": 11}
    rest = remaining(layer)
    assert rest.tolist() == [2, 5, 6, 7, 8, 9, 10]
    shares = [rest[r::3].tolist() for r in range(3)]
    assert sorted(sum(shares, [])) == rest.tolist()


def test_repartition_keeps_held_samples_and_drops_the_ghost_copy():
    ds = LengthDataset(known_lengths(20, 1, 60, seed=1))
    sampler = odb.ShardSampler(ds, num_replicas=2, rank=0, shuffle=False)
    run0 = fresh_run_state(5, [])
    run0["position"].update(arrived=4, pending=[[[3], 1, 1, 1, 1, 1.0]], ghost=0)
    run0["planner"]["carry"] = [1]
    run1 = fresh_run_state(5, [])
    run1["position"].update(arrived=3, ghost=2)
    states = [{"epoch": 0, "seed": 1, "budget": None, "run": run} for run in (run0, run1)]
    new = repartition(states, sampler, world=3, rank=1)
    layer = new["run"]["position"]["layers"][-1]
    # rank 0 holds its local positions 1 and 3 (global 2 and 6); the ghosts (0 and 2 locally) are copies
    assert layer == {"world": 2, "arrived": [4, 3], "kept": [2, 6], "total": 20}
    assert new["run"]["position"]["step"] == 5 and new["world_size"] == 3 and new["rank"] == 1
    assert remaining(layer).tolist() == [2, 6] + list(range(7, 20))


# ---- round trips of the state --------------------------------------------------------------------


def step(batch: Any, info: odb.ODBStepInfo) -> Any:
    return info.sample_ids, info.micro_batch, info.loss_scale, info.micro_step


def summary(loader: Any, limit: Optional[int] = None) -> List[Any]:
    return read(loader, limit, record=step)


def through(state: Dict[str, Any], fmt: str) -> Any:
    return json_copy(state) if fmt == "json" else torch_copy(state)


def map_loader() -> odb.ODBDataLoader:
    ds = LengthDataset(known_lengths(200, 1, 60, seed=4))
    return odb.ODBDataLoader(ds, token_budget=180, buffer_size=48, first_window_size=16, shuffle=True, seed=11,
                             collate_fn=pad_collate, gradient_accumulation_steps=2)


def stream_loader(num_workers: int = 0, low: int = 1) -> odb.ODBDataLoader:
    return odb.ODBDataLoader(ew.CountingStream(known_lengths(200, low, 60, seed=5)), token_budget=180, buffer_size=48,
                             first_window_size=16, seed=11, collate_fn=pad_collate, num_workers=num_workers)


@pytest.mark.parametrize("fmt", ["json", "torch"])
@pytest.mark.parametrize("make", [map_loader, stream_loader], ids=["map", "stateful-stream"])
def test_state_round_trips_through_json_and_torch_save_weights_only(fmt, make):
    reference_loader = make()
    reference = summary(reference_loader)
    reference_next = summary(reference_loader)
    for stop in (1, len(reference) // 2 + 1):
        got = round_trip(make, stop, record=step, save=lambda state: through(state, fmt), next_epoch=True)
        plain(got.state)
        assert got.epoch == reference, f"stop={stop}: the resumed epoch differs"
        assert got.next_epoch == reference_next


def test_a_list_of_one_state_on_the_same_world_size_resumes_exactly():
    reference = summary(map_loader())
    got = round_trip(map_loader, 4, record=step, save=lambda state: [json_copy(state)])
    assert got.epoch == reference


# ---- IterableDatasets with their own state ---------------------------------------------------------


@pytest.mark.parametrize("low", [1, 40], ids=["lengths-1-60", "lengths-40-60"])
def test_stateful_stream_restarts_from_its_state_instead_of_replaying(low):
    """The stream restarts at the last chunk boundary before the first sample the state holds; with
    lengths that pack well (nothing carried for long) that is within about a window of the stop."""
    n = 200
    reference = summary(stream_loader(low=low))
    got = round_trip(lambda: stream_loader(low=low), len(reference) // 2, record=step, save=same)
    run = got.state["run"]
    start, held = run["position"]["stream"]["start"], min(retained_positions(run))
    assert start <= held < start + 16  # chunk boundaries every transfer_chunk_size=16 samples
    if low == 40:  # the window being emitted, the carry from the one before, and a chunk at most
        arrived = run["position"]["arrived"]
        assert arrived - start <= 2 * 48 + 16, f"replays {arrived - start} samples"
    assert got.epoch == reference
    assert got.resumed.dataset.reads[0] == n - start  # a replay would read all n again
    replayed = odb.ODBDataLoader(StreamDataset(known_lengths(n, low, 60, seed=5)), token_budget=180, buffer_size=48,
                                 first_window_size=16, seed=11, collate_fn=pad_collate)
    summary(replayed, len(reference) // 2)
    assert replayed.state_dict()["run"]["position"]["stream"] is None  # no state of its own: replayed from position 0


@pytest.mark.parametrize("num_workers", [0, 2])
def test_datasets_iterable_dataset_resumes_exactly(num_workers):
    def make():
        return odb.ODBDataLoader(ew.hf_stream(181, shards=4), token_budget=200, buffer_size=32, first_window_size=16,
                                 seed=3, collate_fn=ew.list_collate, num_workers=num_workers)

    def row(batch, info):
        return tuple(batch["idx"]), info.micro_batch

    reference = read(make(), record=row)
    assert sorted(i for ids, _ in reference for i in ids) == list(range(181))
    # late: the short samples carried since the first windows are out
    got = round_trip(make, len(reference) - 3, record=row, save=torch_copy)
    state = got.loaded
    stream = state["run"]["position"]["stream"]
    assert len(stream["states"]) == max(num_workers, 1)  # one dataset state per worker
    held = min(retained_positions(state["run"]))
    assert 0 < stream["start"] <= held < stream["start"] + 16 * max(num_workers, 1)
    assert got.epoch == reference


# ---- what is refused, and why -------------------------------------------------------------------


def shard_loader(dataset_len: int = 120, seed: int = 3, shuffle: bool = False) -> odb.ODBDataLoader:
    ds = LengthDataset(known_lengths(dataset_len, 1, 60, seed=4))
    sampler = None if shuffle else odb.ShardSampler(ds, num_replicas=1, rank=0, seed=seed)
    return odb.ODBDataLoader(ds, token_budget=180, buffer_size=48, sampler=sampler, shuffle=shuffle or None,
                             seed=1, collate_fn=pad_collate)


def saved(loader: odb.ODBDataLoader, world: int = 1, rank: int = 0, **run: Any) -> Dict[str, Any]:
    summary(loader, 3)
    state = json.loads(json.dumps(loader.state_dict()))
    state.update(world_size=world, rank=rank)
    state["run"]["position"].update(run)
    return state


@pytest.mark.parametrize("states, message", [
    (lambda: saved(shard_loader(), world=2), r"pass the list of all 2 ranks' states"),
    (lambda: [saved(shard_loader(), world=2)], r"exactly one state of every rank"),
    (lambda: [saved(shard_loader(), 2, 0), saved(shard_loader(), 2, 1, step=9)], r"not saved by one run at one step"),
    (lambda: [saved(shard_loader(seed=4), 2, 0), saved(shard_loader(seed=4), 2, 1)], r"saved with sampler"),
    (lambda: [saved(shard_loader(dataset_len=121), 2, r) for r in (0, 1)], r"dataset of length 121"),
], ids=["one-state-other-world", "missing-rank", "other-steps", "other-sampler-seed", "other-dataset"])
def test_a_state_that_cannot_be_continued_is_refused_with_the_fix(states, message):
    with pytest.raises(ValueError, match=message) as err:
        shard_loader().load_state_dict(states())
    assert "Fix:" in str(err.value)


def test_re_partition_needs_a_stride_sharded_sampler_and_map_style_data():
    states = [saved(shard_loader(shuffle=True), 2, r) for r in (0, 1)]
    with pytest.raises(ValueError, match="stride rule") as err:
        shard_loader(shuffle=True).load_state_dict(states)
    assert "odb.ShardSampler or DistributedSampler" in str(err.value)
    stream = [saved(stream_loader(), 2, r) for r in (0, 1)]
    with pytest.raises(ValueError, match="only map-style data"):
        stream_loader().load_state_dict(stream)


def test_an_iterable_state_needs_the_same_num_workers():
    state = saved(stream_loader(num_workers=0))
    with pytest.raises(ValueError, match=r"num_workers=0, this loader has num_workers=2") as err:
        stream_loader(num_workers=2).load_state_dict(state)
    assert "Fix: resume with num_workers=0" in str(err.value)


def test_elastic_warns_when_saved_inside_an_optimizer_step():
    ds = LengthDataset(known_lengths(120, 1, 60, seed=4))

    def make():
        return odb.ODBDataLoader(ds, token_budget=180, buffer_size=48, seed=1, collate_fn=pad_collate,
                                 sampler=odb.ShardSampler(ds, num_replicas=1, rank=0), gradient_accumulation_steps=3)

    first = make()
    summary(first, 4)  # inside the second optimizer step
    state = first.state_dict()
    assert 0 < state["run"]["position"]["micro_pos"] < len(state["run"]["position"]["micro"])
    halves = []
    for rank in (0, 1):  # as if two ranks had saved it: a re-partition onto this one process
        halves.append(dict(state, world_size=2, rank=rank))
    with pytest.warns(UserWarning, match="inside an optimizer step"):
        make().load_state_dict(halves)
