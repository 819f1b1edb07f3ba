# expect-framework: accelerate
# expect-findings: loss-scale
import torch
from accelerate import Accelerator
import odb
from odb.integrations.accelerate import configure_accelerator
from my_project import SFTDataset, build_model, collate_fn

accelerator = Accelerator(gradient_accumulation_steps=4)
model = build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = SFTDataset("train.jsonl")
loader = configure_accelerator(accelerator, odb.ODBDataLoader(
    data, token_budget=16384, sampler=odb.ShardSampler(data), num_workers=4, collate_fn=collate_fn,
    gradient_accumulation_steps=4))
model, optimizer = accelerator.prepare(model, optimizer)
for batch in loader:
    with accelerator.accumulate(model):
        info = odb.pop_step_info(batch)
        accelerator.backward(model(**batch).loss * info.loss_scale)
        optimizer.step()
        optimizer.zero_grad()
