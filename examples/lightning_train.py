"""PyTorch Lightning with odb on CPU: DDP on 2 processes, uneven data, exact loss scaling, checkpoints.

    python examples/lightning_train.py                       # 2 CPU processes (strategy="ddp", gloo)
    python examples/lightning_train.py --resume PATH.ckpt    # continue from a checkpoint, mid-epoch exactly
    python examples/lightning_train.py --samples 61 --epochs 1  # a quick run

The loader is built in ``train_dataloader()`` (torch.distributed is up there, so
``odb.ShardSampler`` shards by rank) with your batch (``batch_size=8``, accumulated as the Trainer's
``accumulate_grad_batches``: odb cuts each optimizer step into micro-batches under the token budget),
wrapped in ``ODBLightningLoader``; ``ODBCallback`` makes Lightning step where odb's steps end,
hands each batch's step info to the module and logs ``odb/*`` metrics; ``scale_loss``
scales the loss exactly, ghost batches included (they still run backward, no Join).
A checkpoint is written every 5 optimizer steps to ``lightning_logs/``.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import odb
from _common import SyntheticSFT, pad_collate, tiny_llama
from odb.integrations.lightning import ODBCallback, ODBLightningLoader, scale_loss

ACCUMULATION = 2


class LitLM(L.LightningModule):
    def __init__(self, samples: int = 301) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = tiny_llama()
        self.data = SyntheticSFT(n=samples)  # odd: the ranks' shards differ by one sample

    def train_dataloader(self) -> ODBLightningLoader:
        loader = odb.ODBDataLoader(self.data, token_budget=4096, sampler=odb.ShardSampler(self.data, seed=0),
                                   batch_size=8,  # your batch: a step holds 8 x accumulation x processes samples
                                   gradient_accumulation_steps=self.trainer.accumulate_grad_batches,
                                   num_workers=1, collate_fn=pad_collate, buffer_size=128, seed=0,
                                   shift_labels=True)  # HF causal LMs shift labels inside
        return ODBLightningLoader(loader)

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss  # mean over this batch's supervised tokens
        return scale_loss(self, loss)  # * odb_step_info.loss_scale * accumulate_grad_batches

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--resume", default=None, help="a checkpoint written by this script")
    parser.add_argument("--samples", type=int, default=301)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="CPU processes")
    parser.add_argument("--root-dir", default=None, help="where lightning_logs/ goes (default: here)")
    args = parser.parse_args()
    trainer = L.Trainer(accelerator="cpu", devices=args.devices, strategy="ddp", max_epochs=args.epochs,
                        accumulate_grad_batches=ACCUMULATION, log_every_n_steps=5, enable_progress_bar=False,
                        default_root_dir=args.root_dir,
                        callbacks=[ODBCallback(), ModelCheckpoint(every_n_train_steps=5, save_top_k=-1)])
    trainer.fit(LitLM(args.samples), ckpt_path=args.resume)
    if trainer.is_global_zero:
        metrics = {k: round(float(v), 3) for k, v in trainer.callback_metrics.items() if k.endswith("_epoch")
                   or k == "odb/ghost_steps"}
        print(f"{trainer.global_step} optimizer steps; last epoch on rank 0: {metrics}")


if __name__ == "__main__":
    main()
