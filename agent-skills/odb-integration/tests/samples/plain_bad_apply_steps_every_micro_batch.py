# expect-framework: plain_loop
# expect-findings: grad-accum
import torch
from torch.utils.data import DataLoader
import odb
from my_project import SFTDataset, build_model, collate_fn

BATCH = 8
model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
train_loader = DataLoader(SFTDataset("train.jsonl"), batch_size=BATCH, shuffle=True, num_workers=4,
                          collate_fn=collate_fn)
odb.apply(train_loader, token_budget=16384)
for batch in train_loader:
    info = odb.pop_step_info(batch)
    loss = model(**batch).loss * info.loss_scale
    loss.backward()
    opt.step()
    opt.zero_grad()
