# expect-framework: ddp
# expect-findings:
"""torchrun --nproc_per_node=8 ddp_good.py: DistributedSampler, set_epoch, ghosts kept, exact loss scale."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

import odb
from my_project import SFTDataset, build_model, collate_fn


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    model = DDP(build_model().cuda())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = SFTDataset("train.jsonl")
    loader = odb.ODBDataLoader(data, token_budget=16384, sampler=DistributedSampler(data, shuffle=True, seed=0),
                               num_workers=4, collate_fn=collate_fn, pin_memory=True,
                               gradient_accumulation_steps=2)
    for epoch in range(3):
        loader.set_epoch(epoch)
        ghosts = 0
        for batch in loader:
            info = odb.pop_step_info(batch)
            ghosts += info.is_ghost
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = odb.scale_loss(model(**batch).loss, info)  # a ghost's: an exact 0 that still backpropagates
            loss.backward()
            if info.is_last_micro_step:
                opt.step()
                opt.zero_grad()
        stats = loader.odb_stats
        print(rank, epoch, stats["steps"], ghosts, stats["padding_ratio"], stats["rank_imbalance"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
