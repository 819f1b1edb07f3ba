"""Forward + backward time of one padded batch against the same samples as one packed row.

    PYTHONPATH=src python benchmarks/packed_step_cost.py [--attn sdpa|eager] [--repeats 5]

The model is the training benchmark's tiny Llama (odb.bench.training.MODEL, random
weights, CPU). For B samples of L tokens each, the padded batch is (B, L) with an
all-ones attention mask; the packed row is (1, B x L) with position_ids restarting at
every sample. With --attn (sdpa or eager) transformers turns the restarting positions
into a block-diagonal causal mask, dense on CPU: the row's attention costs (B x L)^2,
not B x L^2. With odb's "odb_varlen" (the same weights; odb.register_varlen_attention)
the row's attention runs per sample and costs B x L^2, as flash-attention's varlen
kernel does on a GPU. Prints the median of --repeats timings per shape and the ratios
to the padded batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict

import torch

from odb import register_varlen_attention
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

    def build(attn: str) -> torch.nn.Module:
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(max_position_embeddings=8192, **{**MODEL, "attn_implementation": attn}))

    model, varlen = build(args.attn), build(register_varlen_attention())
    print(f"tiny Llama (CPU, {torch.get_num_threads()} threads): forward + backward, median of {args.repeats}")
    print(f"{'B x L':>10} {'row':>6} {'padded s':>9} {'packed s':>9} {'varlen s':>9} {'packed/padded':>14} "
          f"{'varlen/padded':>14}")
    for b, length in ((4, 256), (8, 128), (16, 256), (4, 1024), (32, 128)):
        ids = torch.randint(1, VOCAB, (b, length))
        padded = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
        row = ids.reshape(1, -1)
        packed = {"input_ids": row, "position_ids": torch.arange(length).repeat(b)[None], "labels": row}
        a, p = step_s(model, padded, args.repeats), step_s(model, packed, args.repeats)
        v = step_s(varlen, packed, args.repeats)
        print(f"{f'{b} x {length}':>10} {b * length:>6} {a:>9.3f} {p:>9.3f} {v:>9.3f} {p / a:>14.2f} {v / a:>14.2f}")


if __name__ == "__main__":
    main()
