"""Plain PyTorch loop with odb: one process, CPU by default.

    python examples/plain_loop.py
    python examples/plain_loop.py --samples 40 --workers 0   # a quick run (tests/project/test_examples.py)
"""

from __future__ import annotations

import argparse

import torch

import odb
from _common import SyntheticSFT, pad_collate, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    opts = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # was: DataLoader(dataset, batch_size=8, shuffle=True, ...) with 2 accumulated batches per optimizer step
    loader = odb.ODBDataLoader(SyntheticSFT(n=opts.samples), batch_size=8, gradient_accumulation_steps=2,
                               token_budget=opts.token_budget, shuffle=True, num_workers=opts.workers,
                               shift_labels=True,  # the LM shifts labels in its loss
                               collate_fn=pad_collate)
    seen = 0
    for batch in loader:
        info = odb.pop_step_info(batch)            # removes odb's metadata from the batch
        loss = odb.scale_loss(model(**batch).loss, info)  # HF mean over supervised tokens, scaled exactly
        loss.backward()
        if info.is_last_micro_step:
            opt.step()
            opt.zero_grad()
        seen += info.all_samples_this_step
        if info.step % 10 == 0:
            print(f"step {info.step:3d} batch {info.local_samples:3d} samples "
                  f"padding {info.padding_ratio:.1%} loss {loss.item() / max(info.loss_scale, 1e-9):.3f}")
    print(f"epoch done: {seen} samples in {len(loader)} steps ({loader.odb_optimizer_steps} optimizer steps); "
          f"stats {loader.odb_stats}")


if __name__ == "__main__":
    main()
