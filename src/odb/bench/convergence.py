"""Convergence on real text: held-out loss against training wall time, per arm.

Each arm trains ``epochs`` epochs over the same real-text samples (``text_data``) from
the same initial weights; every ``1/evals`` of its planned steps the clock stops and
the model's loss on a fixed held-out batch is recorded beside the training seconds so
far. Time to a target loss comes from these curves (``time_to_loss``).

Learning rate: an arm whose steps carry more tokens takes larger steps, so at the same
learning rate it makes less progress per epoch. Every arm gets
``lr = base_lr * sqrt(tokens per step / tokens per step of the fixed arm)``, the
tokens per step estimated before training as the rank's tokens / ``len(loader)``
(square-root scaling, as for Adam with a larger batch: the gradient's noise falls with
the square root of the tokens averaged). ``odb_padded_same_lr`` keeps the fixed arm's
learning rate, to show what the rule changes.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .text_data import TextSamples, held_out_batch, workload_lengths
from .training_arms import ATTENTION, ODB_ARMS, build_loader
from .training_run import _autocast, build_model, set_epoch, train_epoch, wrap

SAME_LR = "_same_lr"


def lr_for(base_lr: float, tokens_per_step: float, base_tokens_per_step: float, rule: str = "sqrt") -> float:
    """The learning rate for steps of ``tokens_per_step`` given ``base_lr`` at ``base_tokens_per_step``.

    Example:
        >>> lr_for(1e-3, 4000, 1000), lr_for(1e-3, 4000, 1000, rule="none")
        (0.002, 0.001)
    """
    if rule not in ("sqrt", "linear", "none"):
        raise ValueError(f"lr_for: rule={rule!r} is not one of 'sqrt', 'linear', 'none'.")
    ratio = tokens_per_step / base_tokens_per_step
    return base_lr * {"sqrt": math.sqrt(ratio), "linear": ratio, "none": 1.0}[rule]


def time_to_loss(curve: Sequence[Tuple[float, float]], target: float) -> Optional[float]:
    """Seconds at which a (seconds, loss) curve first reaches ``target`` (linear between points), or None.

    Example:
        >>> time_to_loss([(0.0, 5.0), (10.0, 3.0), (20.0, 2.0)], 4.0)
        5.0
    """
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if l1 <= target:
            return t0 if l0 <= target else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return curve[0][0] if curve and curve[0][1] <= target else None


def _evaluate(model: torch.nn.Module, batch: Dict[str, torch.Tensor], device: torch.device) -> float:
    module = getattr(model, "module", model)
    with torch.no_grad(), _autocast(device)():
        return float(module(**batch).loss)


def run_convergence(rank: int, world: int, params: Dict[str, Any]) -> Dict[str, Any]:
    """Loss curves of every arm in ``params["arms"]``; rank 0's view."""
    device = torch.device(params.get("device", "cpu"))
    cap, epochs, evals, base_lr = int(params["cap"]), int(params["epochs"]), int(params["evals"]), params["base_lr"]
    lengths = workload_lengths(params["workload"], int(params["samples"]), full_length=bool(params.get("full_length")))
    dataset = TextSamples(lengths)
    rank_tokens = float(lengths.sum()) / world
    base_tps = rank_tokens / len(build_loader("fixed", dataset, cap, rank=rank, world=world))
    held = {k: v.to(device) for k, v in held_out_batch().items()}
    out: Dict[str, Any] = {"arms": {}}
    for name in params["arms"]:
        arm = name[:-len(SAME_LR)] if name.endswith(SAME_LR) else name
        loader = build_loader(arm, dataset, cap, rank=rank, world=world)
        tps = rank_tokens / len(loader)
        lr = base_lr if name.endswith(SAME_LR) else lr_for(base_lr, tps, base_tps)
        model = wrap(build_model(device, int(lengths.max()), ATTENTION.get(arm, "sdpa")), world)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        curve: List[Tuple[float, int, float]] = [(0.0, 0, _evaluate(model, held, device))]
        every = max(1, (len(loader) * epochs) // evals)
        done_s, done_steps = 0.0, 0
        for epoch in range(epochs):
            set_epoch(loader, epoch)
            start, paused = time.perf_counter(), 0.0

            def on_step(step: int) -> float:
                nonlocal paused
                if (done_steps + step) % every:
                    return 0.0
                t = time.perf_counter()
                curve.append((done_s + t - start - paused, done_steps + step, _evaluate(model, held, device)))
                spent = time.perf_counter() - t
                paused += spent
                return spent

            e = train_epoch(model, opt, loader, odb_arm=arm in ODB_ARMS, device=device, world=world, on_step=on_step)
            done_s, done_steps = done_s + e["wall_s"], done_steps + e["steps"]
            if curve[-1][1] != done_steps:
                curve.append((done_s, done_steps, _evaluate(model, held, device)))
        out["arms"][name] = {"lr": lr, "tokens_per_step_planned": tps, "steps": done_steps, "train_s": done_s,
                             "curve": [{"s": s, "step": k, "loss": v} for s, k, v in curve],
                             "final_loss": curve[-1][2]}
        if rank == 0:
            print(f"[convergence] {name}: lr {lr:.2e}, {done_steps} steps, {done_s:.1f} s, held-out loss "
                  f"{curve[0][2]:.3f} -> {curve[-1][2]:.3f}", file=sys.stderr, flush=True)
        del loader, model, opt
    finals = [a["final_loss"] for a in out["arms"].values()]
    out["target_loss"] = max(finals)
    for a in out["arms"].values():
        a["time_to_target_s"] = time_to_loss([(p["s"], p["loss"]) for p in a["curve"]], out["target_loss"])
    out.update({"workload": params["workload"], "samples": int(params["samples"]), "epochs": epochs,
                "base_lr": base_lr, "lr_rule": "sqrt", "base_tokens_per_step": base_tps,
                "held_out": {"samples": int(held["input_ids"].shape[0]), "length": int(held["input_ids"].shape[1])}})
    return out
