"""No gloo group of odb's outlives its use.

odb makes its own gloo groups (one per epoch for the metadata exchange, one more for the
step exchange of known lengths, one per checkpoint gather). A gloo group still alive when
the interpreter exits can abort the process ("terminate called without an active
exception", pytorch issue 190489), and one still alive after the user's
``destroy_process_group()`` can hang its teardown; both were seen with TRL's SFTTrainer
under torchrun. Two real gloo ranks (dist_harness) count the process groups torch holds
before and after each use: an epoch run to its end (online and known lengths, uneven
shards, so the short rank runs ghost steps) and ``gather_states`` leave none behind.
"""

from __future__ import annotations

from typing import Any, Dict

import pytest

from dist_harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]


def groups_left(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    import torch
    import torch.distributed.distributed_c10d as c10d

    import odb
    from helpers import LengthDataset, known_lengths, pad_collate
    from odb.integrations.states import gather_states

    def groups() -> int:
        return len(c10d._world.pg_map)  # the default group and any other this process holds

    lengths = known_lengths(p["n"], 2, 40, seed=1)
    shard = list(range(rank, p["n"], world))[: p["n"] // 4 if rank == 1 else None]  # rank 1 runs out early
    data = torch.utils.data.Subset(LengthDataset(lengths), shard)
    before = groups()
    out: Dict[str, Any] = {"before": before}
    for name, extra in (("online", {}), ("known", {"lengths": [lengths[i] for i in shard]})):
        loader = odb.ODBDataLoader(data, token_budget=p["budget"], buffer_size=8, collate_fn=pad_collate,
                                   gradient_accumulation_steps=2, **extra)
        during, steps = 0, 0
        for batch in loader:
            odb.pop_step_info(batch)
            during = max(during, groups())
            steps += 1
        out[name] = {"during": during, "after": groups(), "steps": steps}
    states = gather_states(loader.state_dict(), loader)
    out["gather"] = {"states": len(states), "after": groups()}
    return out


def test_an_epoch_and_a_checkpoint_gather_leave_no_group_behind(tmp_path):
    results = run_ranks("test_groups:groups_left", 2, {"n": 64, "budget": 120}, tmp_path, deadline_s=120)
    for rank, r in enumerate(results):
        for name in ("online", "known"):
            assert r[name]["during"] > r["before"], f"rank {rank} {name}: odb made no group of its own"
            assert r[name]["after"] == r["before"], f"rank {rank} {name}: {r[name]['after'] - r['before']} group(s) " \
                                                    f"of odb still alive after the epoch"
        assert r["gather"] == {"states": 2, "after": r["before"]}, f"rank {rank}: {r['gather']}"
    assert results[0]["online"]["steps"] == results[1]["online"]["steps"]
