# expect-framework: plain_loop
# expect-findings:
"""A correct single-process odb loop: the shape every other sample is a variant of."""
import torch

import odb
from my_project import SFTDataset, build_model, collate_fn


def main():
    model = build_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = odb.ODBDataLoader(SFTDataset("train.jsonl"), token_budget=16384, shuffle=True, num_workers=4,
                               collate_fn=collate_fn, gradient_accumulation_steps=4)
    for epoch in range(3):
        for batch in loader:
            info = odb.pop_step_info(batch)
            batch = {k: v.cuda(non_blocking=True) for k, v in batch.items()}
            loss = odb.scale_loss(model(**batch).loss, info)
            loss.backward()
            if info.is_last_micro_step:
                opt.step()
                opt.zero_grad()
            print(f"step {info.micro_batch} loss {loss.item() / max(info.loss_scale, 1e-9):.3f}")
        print(epoch, loader.odb_stats["padding_ratio"])


if __name__ == "__main__":
    main()
