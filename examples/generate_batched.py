"""Batched generation under a token budget with odb: a tiny encoder-decoder (T5, random init) on CPU.

    python examples/generate_batched.py
    python examples/generate_batched.py --inputs 40   # a quick run

Inputs of very different lengths are grouped by length so that every call to
``generate`` costs at most rows x (longest input + max_new_tokens) <= token_budget;
outputs come back in input order, each as ``generate`` returns it for that input alone.
A batch that runs out of memory is halved and retried (odb.train.generation).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import T5Config, T5ForConditionalGeneration

from odb.bench.workloads import lognormal_lengths
from odb.train.generation import generate_batched, plan_generation_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inputs", type=int, default=200)
    opts = parser.parse_args()
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
                   pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, initializer_factor=10.0)
    model = T5ForConditionalGeneration(cfg).eval()
    lengths = lognormal_lengths(40, 0.6, opts.inputs, 0).clip(2, 256)
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randint(2, cfg.vocab_size, (int(n),), generator=gen).tolist() for n in lengths]
    budget, max_new = 2048, 16

    plan = plan_generation_batches([len(x) for x in inputs], token_budget=budget, max_new_tokens=max_new)
    real = sum(len(x) + max_new for x in inputs)
    padded = sum(len(g) * (max(len(inputs[i]) for i in g) + max_new) for g in plan)
    print(f"{len(inputs)} inputs (length {min(lengths)}..{max(lengths)}) -> {len(plan)} generate calls, "
          f"batch sizes {min(map(len, plan))}..{max(map(len, plan))}, token efficiency {real / padded:.0%}")

    start = time.perf_counter()
    outputs = generate_batched(model, inputs, token_budget=budget, max_new_tokens=max_new, do_sample=False)
    batched_s = time.perf_counter() - start

    check = range(0, len(inputs), 20)  # one generate call per input for a sample of them
    start = time.perf_counter()
    alone = {i: model.generate(input_ids=torch.tensor([inputs[i]]), max_new_tokens=max_new, do_sample=False)[0]
             for i in check}
    per_input_s = (time.perf_counter() - start) / len(check)
    same = all(outputs[i].tolist() == alone[i].tolist() for i in check)
    print(f"batched: {batched_s:.1f} s for {len(inputs)} inputs; one call per input would take about "
          f"{per_input_s * len(inputs):.1f} s; outputs equal to unbatched greedy on {len(check)} checked: {same}")
    print(f"input 0 ({len(inputs[0])} tokens) -> {outputs[0].tolist()}")


if __name__ == "__main__":
    main()
