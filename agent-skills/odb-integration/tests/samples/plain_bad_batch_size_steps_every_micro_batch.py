# expect-framework: plain_loop
# expect-findings: grad-accum
import torch
import odb
from my_project import SFTDataset, build_model, collate_fn

model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = odb.ODBDataLoader(SFTDataset("train.jsonl"), token_budget=16384, batch_size=8, shuffle=True,
                           num_workers=4, collate_fn=collate_fn)
for batch in loader:
    info = odb.pop_step_info(batch)
    loss = model(**batch).loss * info.loss_scale
    loss.backward()
    opt.step()
    opt.zero_grad()
