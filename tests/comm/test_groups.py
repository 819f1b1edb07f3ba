"""odb's gloo groups do not pile up, and none is left when the process exits.

odb makes its own gloo groups (one per epoch for the metadata exchange, one more for the
step exchange of known lengths, one for the checkpoint gathers). A group is released once
every rank is known to be done with it: when the next one is created (``new_group`` is
collective); the last ones at exit, after a short barrier. A gloo group still alive while
the interpreter finalizes can abort the process ("terminate called without an active
exception", pytorch issue 190489): seen with TRL's SFTTrainer under torchrun, rank 1
exiting with SIGABRT after training. Two real gloo ranks (dist_harness) count the process
groups torch holds over three epochs of each mode and two gathers, then run odb's exit
handler and count again.
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
    import odb.comm.dist
    from helpers import LengthDataset, known_lengths, pad_collate
    import odb.integrations.states
    from odb.integrations.states import gather_states

    def groups() -> int:
        return len(c10d._world.pg_map)  # the default group and any other this process holds

    lengths = known_lengths(p["n"], 2, 40, seed=1)
    shard = list(range(rank, p["n"], world))[: p["n"] // 4 if rank == 1 else None]  # rank 1 runs out early
    data = torch.utils.data.Subset(LengthDataset(lengths), shard)
    out: Dict[str, Any] = {"before": groups()}
    for name, extra in (("online", {}), ("known", {"lengths": [lengths[i] for i in shard]})):
        loader = odb.ODBDataLoader(data, token_budget=p["budget"], buffer_size=8, collate_fn=pad_collate,
                                   gradient_accumulation_steps=2, **extra)
        after = []
        for epoch in range(3):
            loader.set_epoch(epoch)
            for batch in loader:
                odb.pop_step_info(batch)
            after.append(groups())
        out[name] = after
    used = []
    for _ in range(2):
        assert len(gather_states(loader.state_dict(), loader)) == world
        used.append(odb.integrations.states._previous[1])  # the exchange the gather ran on
    out["one_gather_group"] = used[0] is used[1]
    out["gathers"] = groups()
    odb.comm.dist.release_at_exit()
    out["exit"] = groups()
    return out


def test_groups_do_not_pile_up_and_none_is_left_at_exit(tmp_path):
    results = run_ranks("test_groups:groups_left", 2, {"n": 64, "budget": 120}, tmp_path, deadline_s=120)
    for rank, r in enumerate(results):
        base = r["before"]
        assert r["online"] == [base + 1] * 3, f"rank {rank}: groups after each online epoch {r['online']}"
        # known lengths: the last online epoch's group stays (that loader is never iterated again) + 2 of its own
        assert r["known"] == [base + 3] * 3, f"rank {rank}: groups after each known-lengths epoch {r['known']}"
        assert r["gathers"] == base + 4, f"rank {rank}: groups after two checkpoint gathers {r['gathers']}"
        assert r["one_gather_group"], f"rank {rank}: the second checkpoint gather made a group of its own"
        assert r["exit"] == base, f"rank {rank}: {r['exit'] - base} group(s) of odb left at exit"
