# expect-framework: accelerate
# expect-findings: ddp-sampler
import torch
from accelerate import Accelerator
import odb
from odb.integrations.accelerate import configure_accelerator
from my_project import SFTDataset, build_model, collate_fn

accelerator = Accelerator()
model = build_model()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = odb.ODBDataLoader(SFTDataset("train.jsonl"), token_budget=16384, shuffle=True, num_workers=4,
                           collate_fn=collate_fn)
loader = configure_accelerator(accelerator, loader)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for batch in loader:
    info = odb.pop_step_info(batch)
    accelerator.backward(model(**batch).loss * info.loss_scale)
    optimizer.step()
    optimizer.zero_grad()
