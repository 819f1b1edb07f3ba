# expect-framework: plain_loop
# expect-findings: grad-accum
import torch
import odb
from my_project import SFTDataset, build_model, collate_fn

ACCUM = 4
model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = odb.ODBDataLoader(SFTDataset("train.jsonl"), token_budget=16384, shuffle=True, num_workers=4,
                           collate_fn=collate_fn)
for step, batch in enumerate(loader):
    info = odb.pop_step_info(batch)
    loss = model(**batch).loss * info.loss_scale
    loss.backward()
    if (step + 1) % ACCUM == 0:
        opt.step()
        opt.zero_grad()
