# expect-framework: plain_loop
# expect-findings: step-info-order
import torch
import odb
from my_project import SFTDataset, build_model, collate_fn

device = torch.device("cuda")
model = build_model().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = odb.ODBDataLoader(SFTDataset("train.jsonl"), token_budget=16384, shuffle=True, num_workers=4,
                           collate_fn=collate_fn, pin_memory=True)
for batch in loader:
    batch = {k: v.to(device) for k, v in batch.items()}
    info = odb.pop_step_info(batch)
    loss = model(**batch).loss * info.loss_scale
    loss.backward()
    opt.step()
    opt.zero_grad()
