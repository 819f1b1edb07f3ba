"""Rank workers for tests/train/test_oom.py (run by dist_harness.run_ranks as "oom_workers:<name>").

A DDP model over the shards and lengths of dist_workers' gradient test; on the rank
``oom_rank`` a pass with more than ``k`` rows raises torch.OutOfMemoryError in forward
or in backward (the one fake: CPU has no OOM to provoke). The model carries a buffer,
so DDP broadcasts at every forward and any mismatch in pass counts across ranks would
break the collectives.
"""

from __future__ import annotations

from typing import Any, Dict, List

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import odb
from dist_workers import grad_lengths, grad_shards, lm_model
from helpers import LengthDataset, make_sample, pad_collate
from odb.train.oom import OOMCounters, train_step_with_oom_fallback

VOCAB = 50


class FakeOOM(torch.autograd.Function):
    """Identity; raises torch.OutOfMemoryError in forward or backward when the batch has more than k rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: int, where: str) -> torch.Tensor:
        ctx.k, ctx.where = k, where
        if where == "forward" and x.shape[0] > k:
            raise torch.OutOfMemoryError(f"fake: {x.shape[0]} rows > {k} in forward")
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        if ctx.where == "backward" and grad.shape[0] > ctx.k:
            raise torch.OutOfMemoryError(f"fake: {grad.shape[0]} rows > {ctx.k} in backward")
        return grad, None, None


class OOMLM(torch.nn.Module):
    """dist_workers.lm_model (same parameters) with a fake memory limit between embedding and head.

    The head's gradient is accumulated before the failing backward node is reached, so a
    backward OOM leaves a partial gradient, the case the masking must handle.
    """

    def __init__(self, seed: int, k: int, where: str) -> None:
        super().__init__()
        self.inner = lm_model(seed)
        self.k, self.where = k, where
        self.register_buffer("calls", torch.zeros(1, dtype=torch.float64))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = FakeOOM.apply(self.inner[0](ids), self.k, self.where)
        return self.inner[1](hidden)


def token_mean_loss(model: torch.nn.Module, batch: Dict[str, Any]) -> torch.Tensor:
    logits = model(batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), batch["labels"].reshape(-1),
                                             ignore_index=-100)


def ddp_oom(rank: int, world: int, p: Dict[str, Any]) -> List[Dict[str, Any]]:
    """For each scenario, one epoch per accumulation setting: per optimizer step the synced gradient and what
    happened to each micro-batch; the rank's counters."""
    ds = LengthDataset(grad_lengths(world, p))
    out = []
    for sc in p["scenarios"]:
        loader = odb.ODBDataLoader(ds, token_budget=p["budget"], sampler=grad_shards(world, p)[rank],
                                   buffer_size=p["buffer"], collate_fn=pad_collate, seed=0,
                                   gradient_accumulation_steps=sc["accumulation"])
        model = OOMLM(p["seed"], sc["k"] if rank == p["oom_rank"] else 10**6, sc["where"])
        model = DDP(model) if sc.get("ddp", True) else model  # else: gradients all-reduced by hand below
        counters = OOMCounters()
        steps: List[Dict[str, Any]] = []
        micro: List[Dict[str, Any]] = []
        for batch in loader:
            info = odb.pop_step_info(batch)
            outcome = train_step_with_oom_fallback(lambda b: token_mean_loss(model, b), batch, info, model=model,
                                                   policy=sc["policy"], sync_pass=sc["sync_pass"],
                                                   counters=counters)
            micro.append({"ids": list(info.sample_ids), "passes": outcome.passes, "action": outcome.action,
                          "ooms": outcome.local_ooms, "any_oom": outcome.any_oom, "exact": outcome.exact,
                          "skipped": outcome.skipped_rows})
            if info.is_last_micro_step:
                if not isinstance(model, DDP):
                    for t in model.parameters():
                        torch.distributed.all_reduce(t.grad)
                        t.grad /= world
                steps.append({"grads": [t.grad.detach().clone() for t in model.parameters()], "micro": micro})
                micro = []
                model.zero_grad(set_to_none=False)
        out.append({"steps": steps, "counters": counters.as_dict()})
    return out


def sync_backward_oom(rank: int, world: int, p: Dict[str, Any]) -> str:
    """sync_pass='last', an OOM inside the syncing backward of rank 1: what each rank saw (none may hang).

    Rank 1 must raise ODBOOMError; rank 0 waits in DDP's all-reduce until rank 1's process
    is gone, then gets gloo's error.
    """
    model = DDP(OOMLM(0, 1 if rank == 1 else 10**6, "backward"))
    batch = pad_collate([make_sample(i, 5) for i in range(4)])
    info = odb.ODBStepInfo(0, 0, 4, 8, 20, 40, 20, 20, 1.0, False, world_size=world)
    try:
        train_step_with_oom_fallback(lambda b: token_mean_loss(model, b), batch, info, model=model, sync_pass="last")
    except Exception as err:  # what the test checks
        return f"{type(err).__name__}: {err}"
    return "finished"
