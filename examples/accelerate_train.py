"""Hugging Face Accelerate with odb on CPU: prepare, accumulate, exact loss scaling, resume.

    torchrun --nproc_per_node=2 examples/accelerate_train.py
    accelerate launch --multi_gpu --num_processes=2 examples/accelerate_train.py   # same (CPU: cpu=True below)
    python examples/accelerate_train.py                                            # one process
    python examples/accelerate_train.py --samples 64 --checkpoint /tmp/ckpt       # a quick run

The loader is built after ``Accelerator()`` (so ``odb.ShardSampler`` sees the process
group), wrapped by ``configure_accelerator`` and passed through ``accelerator.prepare``
untouched. Epoch 1 saves a checkpoint after 4 batches; then a "restarted" run (fresh
Accelerator, model, optimizer and loader) loads it and trains the rest of epoch 1, which
must be exactly the batches the first run trained after the checkpoint.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any, List, Tuple

import torch
from accelerate import Accelerator

import odb
from _common import SyntheticSFT, pad_collate, tiny_llama
from odb.integrations.accelerate import configure_accelerator, scale_loss

ACCUMULATION = 2


def setup(data: SyntheticSFT) -> Tuple[Accelerator, Any, Any, Any]:
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATION)
    torch.manual_seed(0)
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = odb.ODBDataLoader(data, token_budget=4096, sampler=odb.ShardSampler(data, seed=0), num_workers=1,
                               collate_fn=pad_collate, buffer_size=128, seed=0, shift_labels=True,  # HF LMs shift
                               gradient_accumulation_steps=ACCUMULATION)
    loader = configure_accelerator(accelerator, loader)  # checks, device placement, save_state registration
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # the odb loader passes through
    return accelerator, model, optimizer, loader


def train(accelerator: Accelerator, model: Any, optimizer: Any, loader: Any, title: str, checkpoint: str = "",
          save_after: int = 0) -> List[Tuple[int, ...]]:
    """One epoch; returns the sample ids of the batches after ``save_after`` (when a checkpoint is saved)."""
    trained, seen = [], 0
    for n, batch in enumerate(loader, 1):
        with accelerator.accumulate(model):
            info = odb.pop_step_info(batch)
            accelerator.backward(scale_loss(accelerator, model(**batch).loss, info))  # ghosts: scale 0
            optimizer.step()
            optimizer.zero_grad()
        seen += info.all_samples_this_step
        trained.append(info.sample_ids)
        if checkpoint and n == save_after:
            accelerator.save_state(checkpoint)  # on every rank: it holds every rank's odb state
    stats = loader.odb_stats
    accelerator.print(f"{title}: {stats['steps']} batches per rank, {seen} samples (all ranks), ghost steps "
                      f"{stats['ghost_steps']}, padding {stats['padding_ratio']:.1%}")
    return trained[save_after:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--save-after", type=int, default=4, help="batches of epoch 1 before the checkpoint")
    parser.add_argument("--checkpoint", default=os.path.join(tempfile.gettempdir(), "odb_accelerate_example"))
    opts = parser.parse_args()
    data = SyntheticSFT(n=opts.samples)
    accelerator, model, optimizer, loader = setup(data)
    checkpoint = opts.checkpoint
    for epoch in range(2):
        loader.set_epoch(epoch)
        after = train(accelerator, model, optimizer, loader, f"epoch {epoch}", checkpoint if epoch == 1 else "",
                      save_after=opts.save_after)
    accelerator.wait_for_everyone()  # the checkpoint is on disk before anyone reads it

    accelerator, model, optimizer, loader = setup(data)  # as after a restart
    accelerator.load_state(checkpoint)  # model, optimizer, RNG and odb loader: epoch 1 after the checkpoint
    resumed = train(accelerator, model, optimizer, loader, f"epoch 1, resumed after batch {opts.save_after}")
    print(f"rank {accelerator.process_index}: the resumed run trained the same {len(resumed)} batches as the first "
          f"run after its checkpoint: {resumed == after}")


if __name__ == "__main__":
    main()
