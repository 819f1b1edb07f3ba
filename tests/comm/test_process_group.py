"""``process_group=``: odb's exchanges run on fresh gloo groups over that group's ranks, never on it.

One loader exchanges on two threads at once with known lengths (the batch thread plans; the training
thread exchanges each optimizer step's supervised tokens). On the user's one group their collectives
interleaved, and gloo aborted every process ("Received data size doesn't match expected size", SIGABRT,
no Python error), with and without ``global_batch_size``. Real gloo ranks (dist_harness): a group of all
ranks gives exactly the batches of the default group, for online and known lengths, two epochs each; a
group of 2 of 3 ranks (the third never builds a loader) gives every sample of its sampler once per epoch.
"""

from __future__ import annotations

from typing import Any, Dict, List

import pytest

from dist_harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]

CASES = {"online": {}, "known": {"known": True}, "known_global": {"known": True, "global_batch_size": 12},
         "online_global": {"global_batch_size": 12}}


def epochs_of(rank: int, world: int, p: Dict[str, Any], case: Dict[str, Any], group: Any) -> List[List[Any]]:
    import torch.distributed as dist  # noqa: F401 (the harness initialised it)
    from torch.utils.data import DistributedSampler

    import odb
    from helpers import LengthDataset, known_lengths, pad_collate

    lengths = known_lengths(p["n"], 2, 40, seed=3)
    data = LengthDataset(lengths)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    options = {k: v for k, v in case.items() if k != "known"}
    loader = odb.ODBDataLoader(data, token_budget=p["budget"], sampler=sampler, collate_fn=pad_collate, seed=1,
                               lengths=lengths if case.get("known") else None, process_group=group, **options)
    out = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        steps = []
        for batch in loader:
            info = odb.pop_step_info(batch)
            steps.append((info.step, info.micro_step, list(batch["idx"]), info.global_loss_tokens, info.loss_scale))
        out.append({"steps": steps, "expected": sorted(sampler)})
    return out


def all_ranks_group(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), backend="gloo")
    return {name: {"group": epochs_of(rank, world, p, case, group), "default": epochs_of(rank, world, p, case, None)}
            for name, case in CASES.items()}


def subgroup(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    import torch.distributed as dist

    group = dist.new_group([0, 1], backend="gloo", use_local_synchronization=True)
    if rank not in (0, 1):
        return {}
    # (the DistributedSampler's replicas are the group's 2 ranks)
    return {name: epochs_of(rank, 2, p, CASES[name], group) for name in ("known", "known_global")}


def test_a_group_of_all_ranks_gives_the_default_groups_batches(tmp_path):
    results = run_ranks("test_process_group:all_ranks_group", 2, {"n": 48, "budget": 120}, tmp_path, deadline_s=120)
    for rank, r in enumerate(results):
        for name, got in r.items():
            assert got["group"] == got["default"], f"rank {rank}, {name}: process_group= changed the batches"
            for e, epoch in enumerate(got["group"]):
                assert epoch["steps"], f"rank {rank}, {name}, epoch {e}: no batch"
    for name in CASES:
        for e in range(2):
            seen = sorted(i for r in results for _, _, idx, _, _ in r[name]["group"][e]["steps"] for i in idx)
            expected = sorted(i for r in results for i in r[name]["group"][e]["expected"])
            assert seen == expected, f"{name}, epoch {e}: the ranks' samples are not their samplers' samples"


def test_a_group_of_some_ranks_serves_them_alone(tmp_path):
    results = run_ranks("test_process_group:subgroup", 3, {"n": 40, "budget": 120}, tmp_path, deadline_s=120)
    assert results[2] == {}
    for name in ("known", "known_global"):
        for e in range(2):
            seen = sorted(i for r in results[:2] for _, _, idx, _, _ in r[name][e]["steps"] for i in idx)
            expected = sorted(i for r in results[:2] for i in r[name][e]["expected"])
            assert seen == expected, f"{name}, epoch {e}: every sample of the two ranks' samplers once"
            tokens = {s[3] for r in results[:2] for s in r[name][e]["steps"] if s[1] == 0}
            assert len(results[0][name][e]["steps"]) == len(results[1][name][e]["steps"])
            assert tokens, f"{name}, epoch {e}: no step"
