# expect-framework: ddp
# expect-findings: join
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler
import odb
from my_project import SFTDataset, build_model, collate_fn

dist.init_process_group("nccl")
model = DistributedDataParallel(build_model())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = SFTDataset("train.jsonl")
loader = odb.ODBDataLoader(data, token_budget=16384, sampler=DistributedSampler(data), num_workers=4,
                           collate_fn=collate_fn, join=False)
for batch in loader:
    info = odb.pop_step_info(batch)
    loss = model(**batch).loss * info.loss_scale
    loss.backward()
    opt.step()
    opt.zero_grad()
