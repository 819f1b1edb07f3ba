"""CUDA smoke test of odb's pinning and a short training run (needs a GPU; CI has none).

    PYTHONPATH=src python benchmarks/cuda_smoke.py

Checks, for the online layout and the known-lengths layout (workers collate):
- with ``pin_memory=True`` every tensor of every batch arrives pinned (pinned on odb's batch
  thread, or by the inner DataLoader's pin thread), and copies to the GPU with non_blocking=True;
- a tiny Llama trains a few dozen steps on CUDA with the loss scaled by ``info.loss_scale`` and the
  loss stays finite; prints tokens/s and peak GPU memory.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

import odb
from odb.bench.loader_speed import LengthDataset, pad_collate


def run(known: bool) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device("cuda")
    lengths = np.clip(np.random.default_rng(0).lognormal(np.log(300), 0.8, 2000).astype(int), 16, 2048)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=1024,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                         max_position_embeddings=2048)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = odb.ODBDataLoader(LengthDataset(lengths), token_budget=16384, shuffle=True, seed=0, num_workers=2,
                               pin_memory=True, collate_fn=pad_collate, lengths=lengths if known else None)
    torch.cuda.reset_peak_memory_stats()
    tokens, steps, t0 = 0, 0, time.perf_counter()
    for batch in loader:
        info = odb.pop_step_info(batch)
        unpinned = [k for k, v in batch.items() if isinstance(v, torch.Tensor) and not v.is_pinned()]
        if unpinned:
            raise SystemExit(f"FAIL: batch fields {unpinned} are not pinned (known={known})")
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        loss = model(**batch).loss
        if not torch.isfinite(loss):
            raise SystemExit(f"FAIL: loss {loss} (known={known})")
        (loss * info.loss_scale).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        tokens += info.real_tokens
        steps += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"known_lengths={known}: {steps} steps, all batches pinned, {tokens / dt:,.0f} real tokens/s, "
          f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, loader wait "
          f"{loader.odb_stats['wait_s']:.2f} s of {dt:.2f} s")


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this smoke test needs a GPU")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    for known in (False, True):
        run(known)
    print("OK")


if __name__ == "__main__":
    main()
    sys.exit(0)
