"""Training speed where users decide: real training steps of a small Llama, odb against what users pick instead.

Real forward + backward + AdamW steps of a Llama built from a config (random init,
nothing downloaded) on real text (``text_data``: Python's documentation, byte tokens),
on 2 gloo DDP ranks and on 1 process (one CPU thread each), every arm under the
same memory cap of padded tokens per micro-batch (``training_arms``). Three workloads
(short pairs, a heavy-tailed instruction mix, long chat), ``rounds`` interleaved rounds
(arm order rotated, same seeds), medians with min-max spread (``training_run``). Each
micro-batch is its own optimizer step here: this section measures tokens/s only; time to a
model at the user's samples per step is ``convergence`` (the first section). On ``--device cuda``: one process, bf16 autocast, an ~85M-parameter
Llama, full-length samples and a 4x larger cap; memory from
``torch.cuda.max_memory_allocated``.

Goals (2 ranks, real tokens/s, medians): ``GOALS`` below.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional

from odb.bench.verdict import ratio_spread, straddles
from odb.bench.text_data import VOCAB
from odb.bench.training_arms import ARMS
from odb.bench.training_run import MODELS

MODEL = MODELS["cpu"]  # the CPU model (benchmarks/packed_step_cost.py builds it too)
__all__ = ["MODEL", "VOCAB", "run_training", "training_goals"]

CAP = {"cpu": 4096, "cuda": 16384}
# What each part trains: samples per workload on 2 ranks and on 1 process (the heavy-tailed workload only, with the
# samples of one rank: 2 cores run 2 ranks or 1 process in the same time), rounds, convergence run.
SIZES: Dict[str, Dict[str, Any]] = {
    "full": {"workloads": {"short-pairs": 960, "heavy-tailed": 480, "long-chat": 256},
             "ranks1": {"heavy-tailed": 192}, "rounds": 3},
    # one process on a GPU: the first round of each workload pays each new shape's kernel setup (cuDNN
    # attention plans), so the medians come from the later rounds; sized to fit a 15-minute GPU lease
    "cuda": {"workloads": {"short-pairs": 1200, "heavy-tailed": 320, "long-chat": 128}, "rounds": 3},
    "quick": {"workloads": {"short-pairs": 64, "heavy-tailed": 32, "long-chat": 16}, "ranks1": {"heavy-tailed": 16},
              "rounds": 1},
}
# (name, odb arm, baseline, workloads or None for every one, minimum ratio of real tokens/s)
GOALS = [
    ("odb padded / group_by_length", "odb_padded", "group_by_length", ("heavy-tailed", "short-pairs"), 1.45),
    ("odb padded / group_by_length", "odb_padded", "group_by_length", None, 0.97),
    ("odb packed / group_by_length", "odb_packed", "group_by_length", None, 1.55),
    ("odb packed / TRL packing", "odb_packed", "trl_packing", None, 1.0),
    ("odb padded / fixed", "odb_padded", "fixed", None, 2.5),
]


def training_goals(ranks2: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Every goal on every workload it covers: measured ratio of medians, target, met."""
    out = []
    for name, arm, base, only, target in GOALS:
        for workload, w in ranks2["workloads"].items():
            if (only is None or workload in only) and base in w["arms"] and arm in w["arms"]:
                ratio = w["odb_over"][arm][base]
                spread = ratio_spread(w["arms"][arm]["tokens_per_s"], w["arms"][base]["tokens_per_s"])
                out.append({"goal": f"training (2 ranks) {workload}: real tokens/s, {name}", "measured": ratio,
                            "target": target, "met": ratio >= target, "spread": spread,
                            "straddles": straddles(spread, target)})
    return out


def run_training(*, quick: bool = False, device: str = "cpu", out_dir: Optional[str] = None,
                 timeout_s: float = 1500.0, log: Callable[[str], None] = lambda m: print(m, file=sys.stderr)
                 ) -> Dict[str, Any]:
    """The training section of ``python -m odb.bench``: results (and ``training_loss.png`` under ``out_dir``)."""
    from odb.bench.training_ddp import launch

    kind = "cuda" if device.startswith("cuda") else "cpu"
    size = SIZES["quick" if quick else "cuda" if kind == "cuda" else "full"]
    base = {"device": device, "cap": CAP[kind], "rounds": size["rounds"], "arms": list(ARMS),
            "full_length": kind == "cuda"}
    out: Dict[str, Any] = {"device": device, "cap": CAP[kind], "rounds": size["rounds"], "model": dict(MODELS[kind]),
                           "arms": list(ARMS), "wall_s": {}}
    t0 = time.perf_counter()
    if kind == "cpu":
        both = launch({**base, "threads": 1, "workloads": size["workloads"]}, world=2, timeout_s=timeout_s)
        out["ranks2"] = {**both["workloads_meta"], "workloads": both["workloads"]}
        out["wall_s"]["ranks2"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        one = launch({**base, "threads": 1, "workloads": size["ranks1"]}, world=1, timeout_s=timeout_s)
        out["ranks1"] = {**one["workloads_meta"], "workloads": one["workloads"]}
        out["wall_s"]["ranks1"] = time.perf_counter() - t0
        out["goals"] = training_goals(out["ranks2"])
    else:
        one = launch({**base, "threads": 1, "workloads": size["workloads"]}, world=1, timeout_s=timeout_s)
        out["ranks1"] = {**one["workloads_meta"], "workloads": one["workloads"]}
        out["wall_s"]["ranks1"] = time.perf_counter() - t0
        out["goals"] = []
    return out
