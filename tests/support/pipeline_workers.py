"""Distributed workers for tests/epoch/test_pipeline.py (run by dist_harness as "pipeline_workers:<name>")."""

from __future__ import annotations

from typing import Any, Dict

import odb
from helpers import LengthDataset, known_lengths, pad_collate


def _loader(p: Dict[str, Any], seed: int = 1) -> odb.ODBDataLoader:
    ds = LengthDataset(known_lengths(p["n"], 1, 60, seed=seed))
    return odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=odb.ShardSampler(ds, seed=1),
                             num_workers=p["num_workers"], collate_fn=pad_collate, buffer_size=p["buffer"])


def save_before_first_epoch_then_break_then_full_epoch(rank: int, world: int, p: Dict[str, Any]) -> Dict[str, Any]:
    """Only rank 0 takes a state before training (the usual checkpoint guard); every rank then breaks
    out of an epoch early and runs a full one: exchanges must stay matched throughout."""
    import torch
    import torch.distributed as dist

    loader = _loader(p)
    if rank == 0:
        loader.state_dict()  # must run no collective
    probe = torch.ones(1)
    dist.all_reduce(probe)  # the training loop's own collective, right after
    for k, batch in enumerate(loader):
        if k == p["break_after"]:
            break
    loader.set_epoch(1)
    ids = [i for batch in loader for i in odb.pop_step_info(batch).sample_ids]
    return {"ids": ids, "steps": len(loader), "probe": float(probe)}
