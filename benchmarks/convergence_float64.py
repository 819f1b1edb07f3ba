"""The convergence section's A = 1 arms that make fixed's updates, trained in float64: do their curves agree?

``make demo``'s convergence section trains in float32. At A = 1 the curves of fixed, odb's global plan
and odb's per-rank plan part from step ~32 on in some seeds although every step holds the same samples
(the section checks it). This script trains the same three arms at the section's full size (2 gloo
ranks, A = 1) with every tensor in float64 (``torch.set_default_dtype``, and transformers' loss without
its cast of the logits to float32), and prints, per seed, the largest gap between each odb arm's
held-out loss and fixed's at each evaluated step, and each arm's training time for the same steps.

Run: ``PYTHONPATH=src .venv/bin/python benchmarks/convergence_float64.py [rounds]`` (5 rounds: about
10 minutes on 2 cores). docs/benchmarks.md quotes its figures.
"""

from __future__ import annotations

import sys
import time
from typing import Any, List


def _float64_child(argv: List[str]) -> None:
    import torch
    from torch import nn
    from transformers.loss import loss_utils

    torch.set_default_dtype(torch.float64)

    def causal_lm_loss(logits: Any, labels: Any, vocab_size: int, num_items_in_batch: Any = None,
                       ignore_index: int = -100, shift_labels: Any = None, **kw: Any) -> Any:
        # transformers' ForCausalLMLoss without its logits.float(), which casts float64 logits down to float32
        if shift_labels is None:
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:].contiguous()
        return loss_utils.fixed_cross_entropy(logits.view(-1, vocab_size), shift_labels.view(-1).to(logits.device),
                                              num_items_in_batch, ignore_index, **kw)

    loss_utils.LOSS_MAPPING["ForCausalLM"] = causal_lm_loss
    from odb.bench.training_ddp import child_main

    child_main(argv)


def main(rounds: int) -> None:
    from odb.bench.convergence import BASE_LR, CAP, SIZES
    from odb.bench.training_ddp import launch

    size = {**SIZES["full"], "rounds": rounds, "accumulations": [1]}
    params = {"device": "cpu", "cap": CAP, "threads": 1,
              "convergence": {**size, "base_lr": BASE_LR, "arms": ["fixed", "odb_padded", "odb_padded_rank"]}}
    start = time.time()
    conv = launch(params, world=2, timeout_s=3000, worker=(__file__, "--child"))["convergence"]
    for r in conv["accumulations"]["1"]["rounds"]:
        curves = {a: {p["step"]: p["loss"] for p in m["curve"]} for a, m in r["arms"].items()}
        fixed = curves["fixed"]
        for arm in ("odb_padded", "odb_padded_rank"):
            m = r["arms"][arm]
            gaps = {k: abs(v - fixed[k]) for k, v in curves[arm].items() if k in fixed}
            print(f"seed {r['seed']} {arm:16s} same samples as fixed: {m['same_samples_as_fixed']}; "
                  f"largest |loss - fixed's| {max(gaps.values()):.1e}; per evaluated step: "
                  + " ".join(f"{k}:{g:.0e}" for k, g in sorted(gaps.items())) + f"; {m['train_s']:.1f} s for "
                  f"{m['steps']} steps (fixed {r['arms']['fixed']['train_s']:.1f} s)")
    print(f"wall {time.time() - start:.0f} s")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        _float64_child(sys.argv[2:])
    else:
        main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
