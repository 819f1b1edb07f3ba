"""DDP on CPU (gloo) with odb: every rank runs the same number of steps, loss scaled exactly.

    torchrun --nproc_per_node=2 examples/ddp_train.py
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --samples 48 --epochs 1   # a quick run
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

import odb
from _common import SyntheticSFT, pad_collate, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=400)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    opts = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(tiny_llama())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = SyntheticSFT(n=opts.samples)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    # Your DataLoader(batch_size=4) with 2 accumulated batches: each optimizer step holds 4 x 2 x world samples,
    # cut by odb into micro-batches under the token budget.
    loader = odb.ODBDataLoader(data, batch_size=4, gradient_accumulation_steps=2, token_budget=4096,
                               sampler=sampler, num_workers=opts.workers, collate_fn=pad_collate,
                               shift_labels=True)  # the LM shifts labels
    for epoch in range(opts.epochs):
        loader.set_epoch(epoch)  # also reaches the DistributedSampler
        seen, step_loss, losses = 0, 0.0, []
        for batch in loader:
            info = odb.pop_step_info(batch)
            # Scaled exactly; ghosts and batches without supervised tokens give an exact 0 (still backward).
            micro = model.no_sync() if not info.is_last_micro_step else contextlib.nullcontext()
            with micro:  # DDP averages the gradients once per optimizer step
                loss = odb.scale_loss(model(**batch).loss, info)
                loss.backward()
            step_loss += loss.item()
            seen += info.all_samples_this_step
            if info.is_last_micro_step:
                opt.step()
                opt.zero_grad()
                # The step's token mean over all ranks: each rank's scaled losses add up to its share x world.
                total = torch.tensor(step_loss)
                dist.all_reduce(total)
                losses.append(total.item() / world)
                step_loss = 0.0
        stats = loader.odb_stats
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (stats["steps"], stats["ghost_steps"]))
        if rank == 0:
            print(f"epoch {epoch}: {len(losses)} optimizer steps, micro-batches per rank {[s for s, _ in per_rank]}, "
                  f"ghosts per rank {[g for _, g in per_rank]}, {seen} samples (all ranks), "
                  f"loss {losses[0]:.3f} -> {losses[-1]:.3f} (mean {sum(losses) / len(losses):.3f}), "
                  f"padding {stats['padding_ratio']:.1%}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
