"""A plain PyTorch Lightning program (lightning.pytorch's Trainer, DDP strategy, as a user writes it).

Launched torchrun-style, Lightning finds the ranks by torchrun's variables. An MLP regresses
seeded random data through a DataLoader with a worker process, AdamW with a step schedule,
validation each epoch with metrics synced across ranks, and Lightning's own checkpoint of the
last epoch (model, optimizer, loops). Every rank prints its loss at each step; rank 0 prints a
checksum of its weights and the synced metrics at the end. With --hold FILE every rank waits at
its last step until FILE exists (a test's signal to end).
"""

import argparse
import os
import time

import lightning.pytorch as pl
import torch
from _common import checksum
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--out", required=True, help="Lightning's folder (logs and checkpoints)")
parser.add_argument("--hold", help="at the last step, wait until this file exists")
parser.add_argument("--sleep", type=float, default=0.0, help="seconds to sleep after each step")
args = parser.parse_args()

BATCHES = 8  # per rank and epoch, with 4 ranks


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        print(f"rank {self.global_rank} step {self.global_step} loss {loss.item():.10f}", flush=True)
        self.log("train_loss", loss, sync_dist=True)
        if args.sleep:
            time.sleep(args.sleep)
        last = self.current_epoch == args.epochs - 1 and batch_idx == self.trainer.num_training_batches - 1
        while last and args.hold and not os.path.exists(args.hold):
            time.sleep(0.05)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, 0.5)}


pl.seed_everything(7, workers=True, verbose=False)
generator = torch.Generator().manual_seed(3)
x = torch.randn(16 * BATCHES * 4, 64, generator=generator)
y = x[:, :1] * 2 + torch.randn(len(x), 1, generator=generator) * 0.1
train = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, num_workers=1)
validation = DataLoader(TensorDataset(x[:128], y[:128]), batch_size=32)
model = Regression()
trainer = pl.Trainer(
    accelerator="gpu",
    devices="auto",
    strategy="ddp",
    max_epochs=args.epochs,
    deterministic=True,
    enable_progress_bar=False,
    enable_model_summary=False,
    default_root_dir=args.out,
    log_every_n_steps=4,
)
trainer.fit(model, train, validation)
if trainer.global_rank == 0:
    print(f"rank 0 final {checksum(model)}", flush=True)
    metrics = {name: f"{value.item():.10f}" for name, value in sorted(trainer.callback_metrics.items())}
    print(f"rank 0 metrics {metrics}", flush=True)
