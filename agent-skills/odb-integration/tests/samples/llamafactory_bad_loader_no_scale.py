# expect-framework: llamafactory
# expect-findings: loss-scale
import torch
from torch.utils.data import DataLoader
import odb
from odb.integrations.llamafactory import enable_odb
from my_project import load_everything

model, collator, train_dataset, training_args = load_everything()
loader = DataLoader(train_dataset, batch_size=1, num_workers=4, collate_fn=collator)
enable_odb(train_dataloader=loader, training_args=training_args, token_budget=16384)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
for batch in loader:
    info = odb.pop_step_info(batch)
    model(**batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()
