# expect-framework: lightning
# expect-findings: grad-accum
import lightning as L
import odb
from odb.integrations.lightning import ODBCallback, ODBLightningLoader, scale_loss
from my_project import SFTDataset, build_model, collate_fn


class LitLM(L.LightningModule):
    def train_dataloader(self):
        data = SFTDataset("train.jsonl")
        return ODBLightningLoader(odb.ODBDataLoader(data, token_budget=16384, sampler=odb.ShardSampler(data),
                                                    num_workers=4, collate_fn=collate_fn))

    def training_step(self, batch, batch_idx):
        return scale_loss(self, self.model(**batch).loss)


L.Trainer(accumulate_grad_batches=4, callbacks=[ODBCallback()]).fit(LitLM())
