"""Forward + backward time of one padded batch against the same samples as one packed row.

    PYTHONPATH=src python benchmarks/packed_step_cost.py [--attn sdpa|eager] [--repeats 5]

The model is the training benchmark's tiny Llama (odb.bench.training.MODEL, random
weights, CPU). For B samples of L tokens each, the padded batch is (B, L) with an
all-ones attention mask; the packed row is (1, B x L) with position_ids restarting at
every sample, which transformers turns into a block-diagonal causal mask. With sdpa and
eager on CPU that mask is dense: the row's attention costs (B x L)^2, not B x L^2, so a
packed row is only as cheap as the padded batch when the row is not much longer than
its samples. Varlen kernels (flash-attention on a GPU) pay B x L^2 for the packed row
and no padding; they are not available here. Prints the median of --repeats timings
per shape and the ratio packed / padded.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict

import torch

from odb.bench.training import MODEL, VOCAB


def step_s(model: torch.nn.Module, batch: Dict[str, torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model(**batch).loss.backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])  # the first call warms up


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **{**MODEL, "attn_implementation": args.attn}))
    print(f"tiny Llama ({args.attn}, CPU, {torch.get_num_threads()} threads): forward + backward, median of "
          f"{args.repeats}")
    print(f"{'B x L':>10} {'row':>6} {'padded s':>9} {'packed s':>9} {'packed / padded':>16}")
    for b, length in ((4, 256), (8, 128), (16, 256), (4, 1024), (32, 128)):
        ids = torch.randint(1, VOCAB, (b, length))
        padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        row = ids.reshape(1, -1)
        packed = {"input_ids": row, "position_ids": torch.arange(length).repeat(b)[None], "labels": row}
        a, p = step_s(model, padded, args.repeats), step_s(model, packed, args.repeats)
        print(f"{f'{b} x {length}':>10} {b * length:>6} {a:>9.3f} {p:>9.3f} {p / a:>16.2f}")


if __name__ == "__main__":
    main()
