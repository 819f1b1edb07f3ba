# expect-framework: plain_loop
# expect-findings: batch-size
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler
import odb
from my_project import SFTDataset, build_model, collate_fn

model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
data = SFTDataset("train.jsonl")
train_loader = DataLoader(data, batch_sampler=BatchSampler(RandomSampler(data), 8, False), num_workers=4,
                          collate_fn=collate_fn)
odb.apply(train_loader, token_budget=16384)
for batch in train_loader:
    info = odb.pop_step_info(batch)
    loss = odb.scale_loss(model(**batch).loss, info)
    loss.backward()
    if info.is_last_micro_step:
        opt.step()
        opt.zero_grad()
