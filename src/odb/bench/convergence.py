"""Convergence on real text: held-out loss against training wall time, per arm.

Every arm trains on the same real-text samples (``text_data``) from the same initial
weights for the same training time: the first arm (fixed batching) trains ``epochs``
epochs, every other arm as many epochs as it takes to have trained as long (odb's
epochs are shorter: it runs more of them). The arms take turns epoch by epoch. About
``evals`` times per ``epochs`` epochs of its own the clock stops and the model's loss on
a fixed held-out batch is recorded beside the training seconds so far. Time to a target
loss comes from these curves (``time_to_loss``); the target is the highest final loss
of any arm, which every arm reaches.

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

from odb.bench.text_data import TextSamples, held_out_batch, workload_lengths
from odb.bench.training_arms import ATTENTION, ODB_ARMS, build_loader
from odb.bench.training_run import _autocast, _reduce, build_model, set_epoch, train_epoch, wrap

SAME_LR = "_same_lr"
MAX_EPOCHS_PER_BUDGET = 6  # an arm may train up to 6x the first arm's epochs within its time


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


class _ArmRun:
    """One arm's model, optimizer, loader and loss curve, trained an epoch at a time."""

    def __init__(self, name: str, dataset: TextSamples, cap: int, rank: int, world: int, device: torch.device,
                 base_lr: float, base_tps: float, rank_tokens: float, epochs: int, evals: int,
                 held: Dict[str, torch.Tensor]) -> None:
        self.name, self.world, self.device, self.held = name, world, device, held
        self.arm = name[:-len(SAME_LR)] if name.endswith(SAME_LR) else name
        self.loader = build_loader(self.arm, dataset, cap, rank=rank, world=world)
        self.tps = rank_tokens / len(self.loader)
        self.lr = base_lr if name.endswith(SAME_LR) else lr_for(base_lr, self.tps, base_tps)
        self.model = wrap(build_model(device, int(dataset.lengths.max()), ATTENTION.get(self.arm, "sdpa")), world)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr)
        self.curve: List[Tuple[float, int, float]] = [(0.0, 0, _evaluate(self.model, held, device))]
        self.every = max(1, (len(self.loader) * epochs) // evals)
        self.done_s, self.done_steps, self.epochs = 0.0, 0, 0

    def epoch(self, epoch: int) -> None:
        set_epoch(self.loader, epoch)
        start, paused = time.perf_counter(), 0.0

        def on_step(step: int) -> float:
            nonlocal paused
            if (self.done_steps + step) % self.every:
                return 0.0
            t = time.perf_counter()
            self.curve.append((self.done_s + t - start - paused, self.done_steps + step,
                               _evaluate(self.model, self.held, self.device)))
            spent = time.perf_counter() - t
            paused += spent
            return spent

        e = train_epoch(self.model, self.opt, self.loader, odb_arm=self.arm in ODB_ARMS, device=self.device,
                        world=self.world, on_step=on_step)
        wall = _reduce([e["wall_s"]], "MAX", self.world)[0]  # every rank decides alike whether to go on
        self.done_s, self.done_steps, self.epochs = self.done_s + wall, self.done_steps + e["steps"], self.epochs + 1
        if self.curve[-1][1] != self.done_steps:
            self.curve.append((self.done_s, self.done_steps, _evaluate(self.model, self.held, self.device)))

    def result(self) -> Dict[str, Any]:
        return {"lr": self.lr, "tokens_per_step_planned": self.tps, "steps": self.done_steps, "epochs": self.epochs,
                "train_s": self.done_s,
                "curve": [{"s": s, "step": k, "loss": v} for s, k, v in self.curve], "final_loss": self.curve[-1][2]}


def run_convergence(rank: int, world: int, params: Dict[str, Any]) -> Dict[str, Any]:
    """Loss curves of every arm in ``params["arms"]``; rank 0's view."""
    device = torch.device(params.get("device", "cpu"))
    cap, epochs, evals, base_lr = int(params["cap"]), int(params["epochs"]), int(params["evals"]), params["base_lr"]
    lengths = workload_lengths(params["workload"], int(params["samples"]), full_length=bool(params.get("full_length")))
    dataset = TextSamples(lengths)
    rank_tokens = float(lengths.sum()) / world
    base_tps = rank_tokens / len(build_loader("fixed", dataset, cap, rank=rank, world=world))
    held = {k: v.to(device) for k, v in held_out_batch().items()}
    runs = {name: _ArmRun(name, dataset, cap, rank, world, device, base_lr, base_tps, rank_tokens, epochs, evals,
                          held) for name in params["arms"]}
    names = list(runs)
    first = runs[names[0]]
    budget = math.inf
    for epoch in range(MAX_EPOCHS_PER_BUDGET * epochs):
        # Epoch by epoch, the arms' order rotated: a busy spell of the machine is shared. The first arm trains
        # `epochs` epochs; the others train until they have had its training time.
        active = [n for n in names if (runs[n] is first and first.epochs < epochs)
                  or (runs[n] is not first and runs[n].done_s < budget)]
        if not active:
            break
        for name in active[epoch % len(active):] + active[:epoch % len(active)]:
            runs[name].epoch(epoch)
        if first.epochs >= epochs:
            budget = first.done_s
    out: Dict[str, Any] = {"arms": {}}
    for name, run in runs.items():
        out["arms"][name] = run.result()
        if rank == 0:
            m = out["arms"][name]
            print(f"[convergence] {name}: lr {m['lr']:.2e}, {m['steps']} steps, {m['train_s']:.1f} s, held-out loss "
                  f"{m['curve'][0]['loss']:.3f} -> {m['final_loss']:.3f}", file=sys.stderr, flush=True)
    finals = [a["final_loss"] for a in out["arms"].values()]
    out["target_loss"] = max(finals)
    for a in out["arms"].values():
        a["time_to_target_s"] = time_to_loss([(p["s"], p["loss"]) for p in a["curve"]], out["target_loss"])
    out.update({"workload": params["workload"], "samples": int(params["samples"]), "epochs": epochs,
                "base_lr": base_lr, "lr_rule": "sqrt", "base_tokens_per_step": base_tps,
                "held_out": {"samples": int(held["input_ids"].shape[0]), "length": int(held["input_ids"].shape[1])}})
    return out
