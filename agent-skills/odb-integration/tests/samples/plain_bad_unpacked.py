# expect-framework: plain_loop
# expect-findings: step-info
import torch
import torch.nn.functional as F
import odb
from my_project import PairDataset, build_model, tuple_collate

model = build_model()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
loader = odb.ODBDataLoader(PairDataset(), token_budget=16384, shuffle=True, num_workers=4,
                           collate_fn=tuple_collate)
for step, (inputs, targets) in enumerate(loader):
    loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad()
