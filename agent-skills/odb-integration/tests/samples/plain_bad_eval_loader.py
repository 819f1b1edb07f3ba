# expect-framework: plain_loop
# expect-findings: eval-loader
import torch
import odb
from my_project import SFTDataset, build_model, collate_fn

model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
train_loader = odb.ODBDataLoader(SFTDataset("train.jsonl"), token_budget=16384, shuffle=True, num_workers=4,
                                 collate_fn=collate_fn)
eval_loader = odb.ODBDataLoader(SFTDataset("eval.jsonl"), token_budget=16384, num_workers=4, collate_fn=collate_fn)
for batch in train_loader:
    info = odb.pop_step_info(batch)
    loss = model(**batch).loss * info.loss_scale
    loss.backward()
    opt.step()
    opt.zero_grad()
with torch.no_grad():
    for batch in eval_loader:
        odb.pop_step_info(batch)
        print(model(**batch).loss.item())
