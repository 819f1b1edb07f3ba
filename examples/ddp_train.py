"""DDP on CPU (gloo) with odb: every rank runs the same number of steps, loss scaled exactly.

    torchrun --nproc_per_node=2 examples/ddp_train.py
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --samples 48 --epochs 1   # a quick run
"""

from __future__ import annotations

import argparse

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
    loader = odb.ODBDataLoader(data, token_budget=4096, sampler=sampler, num_workers=opts.workers,
                               collate_fn=pad_collate, buffer_size=128, shift_labels=True)  # the LM shifts labels
    for epoch in range(opts.epochs):
        loader.set_epoch(epoch)  # also reaches the DistributedSampler
        seen = 0
        for batch in loader:
            info = odb.pop_step_info(batch)
            # Scaled exactly; ghosts and batches without supervised tokens give an exact 0 (still backward).
            loss = odb.scale_loss(model(**batch).loss, info)
            loss.backward()
            opt.step()
            opt.zero_grad()
            seen += info.all_samples_this_step
        stats = loader.odb_stats
        print(f"rank {rank}/{world} epoch {epoch}: {stats['steps']} steps, {seen} samples (all ranks), "
              f"ghost steps {stats['ghost_steps']}, padding {stats['padding_ratio']:.1%}, "
              f"rank imbalance {stats['rank_imbalance']:.3f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
