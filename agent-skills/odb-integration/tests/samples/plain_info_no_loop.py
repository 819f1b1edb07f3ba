# expect-framework: plain_loop
# expect-findings: no-loop
"""The odb loader is consumed through an iterator here, so the step checks cannot follow it."""
import torch
import odb
from my_project import SFTDataset, build_model, collate_fn

model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = odb.ODBDataLoader(SFTDataset("train.jsonl"), token_budget=16384, shuffle=True, num_workers=4,
                           collate_fn=collate_fn)
batches = iter(loader)
while True:
    batch = next(batches, None)
    if batch is None:
        break
    info = odb.pop_step_info(batch)
    (model(**batch).loss * info.loss_scale).backward()
    opt.step()
    opt.zero_grad()
