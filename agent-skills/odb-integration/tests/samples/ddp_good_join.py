# expect-framework: ddp
# expect-findings:
"""join=False with torch's Join context manager, ShardSampler (every index exactly once)."""
import torch
import torch.distributed as dist
from torch.distributed.algorithms import Join
from torch.nn.parallel import DistributedDataParallel

import odb
from my_project import SFTDataset, build_model, collate_fn

dist.init_process_group("gloo")
model = DistributedDataParallel(build_model())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = SFTDataset("train.jsonl")
sampler = odb.ShardSampler(data, shuffle=True, seed=0)
loader = odb.ODBDataLoader(data, token_budget=16384, sampler=sampler, num_workers=2, collate_fn=collate_fn,
                           join=False)
with Join([model]):
    for batch in loader:
        info = odb.pop_step_info(batch)
        loss = model(**batch).loss * info.loss_scale
        loss.backward()
        opt.step()
        opt.zero_grad()
