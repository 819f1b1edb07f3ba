# expect-framework: lightning
# expect-findings: odb-missing
import pytorch_lightning as pl
import torch
from my_project import SFTDataset, build_model, collate_fn


class LitLM(pl.LightningModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(SFTDataset("train.jsonl"), batch_size=8, collate_fn=collate_fn)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss


pl.Trainer(devices=2).fit(LitLM())
