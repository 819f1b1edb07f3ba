# expect-framework: lightning
# expect-findings:
"""Lightning DDP: ODBLightningLoader from train_dataloader, ODBCallback, scale_loss; ghosts run as usual."""
import lightning as L
import torch

import odb
from odb.integrations.lightning import ODBCallback, ODBLightningLoader, scale_loss
from my_project import SFTDataset, build_model, collate_fn


class LitLM(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = build_model()
        self.dataset = SFTDataset("train.jsonl")

    def train_dataloader(self):  # torch.distributed is up here, so ShardSampler sees the ranks
        loader = odb.ODBDataLoader(self.dataset, token_budget=16384, sampler=odb.ShardSampler(self.dataset),
                                   num_workers=4, collate_fn=collate_fn, gradient_accumulation_steps=2)
        return ODBLightningLoader(loader)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(SFTDataset("dev.jsonl"), batch_size=8, collate_fn=collate_fn)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.log("train/loss", loss)
        return scale_loss(self, loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


trainer = L.Trainer(strategy="ddp", devices=8, accumulate_grad_batches=2, callbacks=[ODBCallback()])
trainer.fit(LitLM())
