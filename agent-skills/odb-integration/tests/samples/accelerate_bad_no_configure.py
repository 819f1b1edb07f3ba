# expect-framework: accelerate
# expect-findings: integration-missing
import torch
from accelerate import Accelerator
import odb
from my_project import SFTDataset, build_model, collate_fn

accelerator = Accelerator()
model = build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = SFTDataset("train.jsonl")
loader = odb.ODBDataLoader(data, token_budget=16384, sampler=odb.ShardSampler(data), num_workers=4,
                           collate_fn=collate_fn)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for batch in loader:
    info = odb.pop_step_info(batch)
    accelerator.backward(model(**batch).loss * info.loss_scale)
    optimizer.step()
    optimizer.zero_grad()
