# expect-framework: accelerate
# expect-findings:
"""accelerate launch accelerate_good.py: configure_accelerator, scale_loss, matching accumulation."""
import torch
from accelerate import Accelerator

import odb
from odb.integrations.accelerate import configure_accelerator, scale_loss
from my_project import SFTDataset, build_model, collate_fn

ACCUM = 2


def main():
    accelerator = Accelerator(gradient_accumulation_steps=ACCUM)  # before the sampler: it starts the ranks
    model = build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = SFTDataset("train.jsonl")
    loader = odb.ODBDataLoader(data, token_budget=16384, sampler=odb.ShardSampler(data, shuffle=True, seed=0),
                               num_workers=4, collate_fn=collate_fn, gradient_accumulation_steps=ACCUM)
    loader = configure_accelerator(accelerator, loader)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)  # the odb loader passes unchanged
    for epoch in range(3):
        loader.set_epoch(epoch)
        for batch in loader:
            with accelerator.accumulate(model):
                info = odb.pop_step_info(batch)
                accelerator.backward(scale_loss(accelerator, model(**batch).loss, info))
                optimizer.step()
                optimizer.zero_grad()
        accelerator.print(epoch, loader.odb_stats["padding_ratio"])


if __name__ == "__main__":
    main()
