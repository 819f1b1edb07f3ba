# expect-framework: plain_loop
# expect-findings:
"""odb.apply on the DataLoader(batch_size=8) the script had: odb keeps that batch per optimizer step."""
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
    loss = odb.scale_loss(model(**batch).loss, info)
    loss.backward()
    if info.is_last_micro_step:
        opt.step()
        opt.zero_grad()
