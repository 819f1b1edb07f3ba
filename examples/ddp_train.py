"""DDP on CPU (gloo) with odb: every rank runs the same number of steps, loss scaled exactly; a tiny LM learning
English from the paragraphs of Python's own documentation (``pydoc_data.topics``, byte tokens), its loss printed
by rank 0 alone.

    torchrun --nproc_per_node=2 examples/ddp_train.py
    torchrun --standalone --nproc_per_node=2 examples/ddp_train.py --samples 160 --epochs 2   # a quick run
"""

from __future__ import annotations

import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

import odb
from _common import DocText, pad_collate, tiny_llama


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=None, help="paragraphs to train on (default: all, ~2,400)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per rank")
    opts = parser.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DistributedDataParallel(tiny_llama(DocText.VOCAB))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = DocText(n=opts.samples)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    # Your DataLoader(batch_size=4) with 2 accumulated batches: each optimizer step holds 4 x 2 x world samples,
    # cut by odb into micro-batches under the token budget.
    loader = odb.ODBDataLoader(data, batch_size=4, gradient_accumulation_steps=2, token_budget=4096,
                               sampler=sampler, num_workers=opts.workers, collate_fn=pad_collate,
                               shift_labels=True)  # the LM shifts labels
    losses = []  # the token mean of each optimizer step, over all ranks
    for epoch in range(opts.epochs):
        loader.set_epoch(epoch)  # also reaches the DistributedSampler
        seen, step_loss, epoch_start = 0, 0.0, len(losses)
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
                if rank == 0 and len(losses) % 10 == 0:  # one line per 10 optimizer steps, from rank 0 only
                    print(f"optimizer step {len(losses):4d}: loss {losses[-1]:.3f}")
        stats = loader.odb_stats
        per_rank = [None] * world
        dist.all_gather_object(per_rank, (stats["steps"], stats["ghost_steps"]))
        mine = losses[epoch_start:]
        if rank == 0:
            print(f"epoch {epoch}: {len(mine)} optimizer steps, micro-batches per rank {[s for s, _ in per_rank]}, "
                  f"ghosts per rank {[g for _, g in per_rank]}, {seen} samples (all ranks), "
                  f"loss {mine[0]:.3f} -> {mine[-1]:.3f} (mean {sum(mine) / len(mine):.3f}), "
                  f"padding {stats['padding_ratio']:.1%}")
    if rank == 0:
        k = min(5, len(losses))
        print(f"trained: loss {sum(losses[:k]) / k:.3f} (first {k} steps) -> {sum(losses[-k:]) / k:.3f} "
              f"(last {k} steps)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
