"""Plain PyTorch loop with odb: one process, CPU by default, a tiny LM learning English.

The text is the paragraphs of Python's own documentation (``pydoc_data.topics``, shipped with Python), one
sample each, tokenized byte by byte: real lengths (16 to 512 bytes), so odb has something to group, and a loss
that falls from ln(257) = 5.5 as the model learns.

    python examples/plain_loop.py
    python examples/plain_loop.py --samples 160 --epochs 2 --workers 1   # a quick run (tests/project/test_examples.py)
"""

from __future__ import annotations

import argparse

import torch

import odb
from _common import DocText, StepLosses, pad_collate, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=None, help="paragraphs to train on (default: all, ~2,400)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    opts = parser.parse_args()
    torch.manual_seed(0)
    model = tiny_llama(DocText.VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # was: DataLoader(dataset, batch_size=8, shuffle=True, ...) with 2 accumulated batches per optimizer step
    loader = odb.ODBDataLoader(DocText(n=opts.samples), batch_size=8, gradient_accumulation_steps=2,
                               token_budget=opts.token_budget, shuffle=True, num_workers=opts.workers,
                               shift_labels=True,  # the LM shifts labels in its loss
                               collate_fn=pad_collate)
    losses = StepLosses()
    for epoch in range(opts.epochs):
        loader.set_epoch(epoch)
        seen = 0
        for batch in loader:
            info = odb.pop_step_info(batch)            # removes odb's metadata from the batch
            loss = odb.scale_loss(model(**batch).loss, info)  # HF mean over supervised tokens, scaled exactly
            loss.backward()
            losses.add(loss.item(), info.is_last_micro_step)  # the step's loss: its micro-batches' sum
            if info.is_last_micro_step:
                opt.step()
                opt.zero_grad()
                if len(losses.steps) % 10 == 0:
                    print(f"optimizer step {len(losses.steps):4d}: loss {losses.steps[-1]:.3f} "
                          f"(its last micro-batch: {info.local_samples} samples, padding {info.padding_ratio:.1%})")
            seen += info.all_samples_this_step
        print(f"epoch {epoch} done: {seen} samples in {loader.odb_optimizer_steps} optimizer steps; "
              f"padding {loader.odb_stats['padding_ratio']:.1%}")
    print(f"trained: {losses.trend()}")


if __name__ == "__main__":
    main()
