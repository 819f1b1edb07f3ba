# expect-framework: accelerate
# expect-findings: grad-accum
import torch
from accelerate import Accelerator
import odb
from odb.integrations.accelerate import configure_accelerator, scale_loss
from my_project import SFTDataset, build_model, collate_fn

accelerator = Accelerator(gradient_accumulation_steps=8)
model = build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = SFTDataset("train.jsonl")
loader = odb.ODBDataLoader(data, token_budget=16384, sampler=odb.ShardSampler(data), num_workers=4,
                           collate_fn=collate_fn)
train_dl = configure_accelerator(accelerator, loader)
model, optimizer = accelerator.prepare(model, optimizer)
for batch in train_dl:
    with accelerator.accumulate(model):
        info = odb.pop_step_info(batch)
        accelerator.backward(scale_loss(accelerator, model(**batch).loss, info))
        optimizer.step()
        optimizer.zero_grad()
