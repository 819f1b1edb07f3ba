# expect-framework: ddp
# expect-findings:
"""An IterableDataset that shards by rank itself needs no sampler."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import IterableDataset

import odb
from my_project import build_model, collate_fn, read_shard


class Shards(IterableDataset):
    def __iter__(self):
        yield from read_shard(dist.get_rank(), dist.get_world_size())


dist.init_process_group("nccl")
model = DistributedDataParallel(build_model())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = odb.ODBDataLoader(Shards(), token_budget=16384, num_workers=4, collate_fn=collate_fn)
for batch in loader:
    info = odb.pop_step_info(batch)
    loss = model(**batch).loss * info.loss_scale
    loss.backward()
    opt.step()
    opt.zero_grad()
