# expect-framework: plain_loop
# expect-findings:
"""The quickstart: the class name changed, the batch size kept, the optimizer stepping at the step's end."""
import torch
import odb
from my_project import SFTDataset, build_model, collate_fn

model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = odb.ODBDataLoader(SFTDataset("train.jsonl"), batch_size=8, gradient_accumulation_steps=2,
                           token_budget=16384, shuffle=True, num_workers=4, collate_fn=collate_fn)
for batch in loader:
    info = odb.pop_step_info(batch)
    loss = odb.scale_loss(model(**batch).loss, info)
    loss.backward()
    if info.is_last_micro_step:
        opt.step()
        opt.zero_grad()
