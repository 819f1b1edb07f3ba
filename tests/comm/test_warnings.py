"""odb's distributed path emits no FutureWarning or DeprecationWarning on any rank.

Two real gloo ranks (dist_harness) run two epochs with uneven shards (ghost steps),
gradient accumulation, a DataLoader worker and a mid-epoch ``state_dict``, with every
warning shown each time (``simplefilter("always")``, inherited by the forked DataLoader
workers). A warning of the deprecation family anywhere
in a rank's output, the main process or its workers, fails the test, naming it. (torch
2.13 deprecates ``all_gather_into_tensor`` on gloo with a FutureWarning per call: odb's
exchange uses ``dist.all_gather``, which works quietly on every declared torch.)
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Dict

import pytest

from dist_harness import run_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(150)]

DEPRECATION = re.compile(r"\b(FutureWarning|DeprecationWarning|PendingDeprecationWarning)\b")


def quiet_epochs(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """One rank: two epochs of an odb loader on this rank's (uneven) shard, every warning shown."""
    warnings.simplefilter("always")  # DeprecationWarning is hidden outside __main__ by default
    import torch

    import odb
    from helpers import LengthDataset, known_lengths, pad_collate

    lengths = known_lengths(p["n"], 2, 40, seed=3)
    shard = list(range(rank, p["n"], world))[: p["n"] // 3 if rank == 1 else None]  # rank 1 runs out early
    data = torch.utils.data.Subset(LengthDataset(lengths), shard)
    loader = odb.ODBDataLoader(data, token_budget=p["budget"], shuffle=True, seed=0, num_workers=1,
                               buffer_size=8, collate_fn=pad_collate, gradient_accumulation_steps=2)
    steps, ghosts = [], 0
    for epoch in range(2):
        loader.set_epoch(epoch)
        count = 0
        for batch in loader:
            info = odb.pop_step_info(batch)
            ghosts += info.is_ghost
            count += 1
            if epoch == 0 and count == 2:
                loader.state_dict()  # as a trainer checkpointing mid-epoch
        steps.append(count)
    return {"steps": steps, "ghosts": ghosts}


def test_two_rank_epochs_emit_no_deprecation_warnings(tmp_path):
    results = run_ranks("test_warnings:quiet_epochs", 2, {"n": 48, "budget": 160}, tmp_path, deadline_s=120)
    assert results[0]["steps"] == results[1]["steps"] and min(results[0]["steps"]) > 2, results
    assert results[1]["ghosts"] > 0, "rank 1 ran no ghost step: the uneven shards do not test the ghost path"
    for rank in range(2):
        log = (tmp_path / f"rank{rank}.log").read_text(errors="replace")
        found = [line for line in log.splitlines() if DEPRECATION.search(line)]
        assert not found, f"rank {rank} emitted deprecation warnings:\n" + "\n".join(found[:10])
