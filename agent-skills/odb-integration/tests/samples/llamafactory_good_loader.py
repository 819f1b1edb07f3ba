# expect-framework: llamafactory
# expect-findings:
"""Your own loop over LLaMA-Factory's processed data and collator: the loader is converted in place."""
import torch
from torch.utils.data import DataLoader
from llamafactory.data import SFTDataCollatorWith4DAttentionMask
from odb import pop_step_info
from odb.integrations.llamafactory import enable_odb
from my_project import load_everything

model, template, tokenizer_module, dataset_module, training_args = load_everything()
collator = SFTDataCollatorWith4DAttentionMask(template=template, model=model, pad_to_multiple_of=8,
                                              **tokenizer_module)
loader = DataLoader(dataset_module["train_dataset"], batch_size=1, shuffle=True, num_workers=4, collate_fn=collator)
handle = enable_odb(train_dataloader=loader, training_args=training_args, token_budget=16384)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
for batch in loader:
    info = pop_step_info(batch)
    (model(**batch).loss * info.loss_scale).backward()
    if info.is_last_micro_step:
        optimizer.step()
        optimizer.zero_grad()
print(handle.stats["padding_ratio"])
