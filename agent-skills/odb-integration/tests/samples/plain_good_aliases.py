# expect-framework: plain_loop
# expect-findings:
"""Aliased imports, odb.apply on an existing loader, and the step in a helper function."""
import torch
from torch.utils.data import DataLoader as DL

import odb as o
from odb import pop_step_info as pop
from my_project import SFTDataset, build_model, collate_fn


def train_step(model, batch, opt):
    info = pop(batch)
    out = model(**batch)
    scale = info.loss_scale
    (out.loss * scale).backward()
    opt.step()
    opt.zero_grad()
    return info


def main():
    model = build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    dl = DL(SFTDataset("train.jsonl"), batch_size=1, shuffle=True, num_workers=8, collate_fn=collate_fn)
    handle = o.apply(dl, token_budget=8192, pad_to_multiple_of=8)
    for step, batch in enumerate(handle.loader):
        train_step(model, batch, opt)
    print(handle.stats)


main()
