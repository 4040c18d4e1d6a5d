"""A Lightning Trainer script with knobs for the adapter's tests: an explicit precision, a loss
multiplier (to make fp16 overflow), accumulation, manual optimization; it never imports advisor.

It imports the Trainer from the module that defines it, which framework detection does not
read: trials of it pass ``--framework lightning``. It writes the dtype of its first training
forward's logits to --dtype-file (appending), and at the end prints what precision the Trainer
ended up with and its loss scaler.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.pytorch.trainer.trainer import Trainer


class Net(L.LightningModule):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.args = args
        self.automatic_optimization = not args.manual
        self.net = nn.Sequential(nn.Linear(32, args.width), nn.ReLU(), nn.Linear(args.width, 4))
        self._dtype_written = False

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        if self.args.dtype_file and not self._dtype_written:
            with open(self.args.dtype_file, "a") as f:
                f.write(f"{logits.dtype}\n")
            self._dtype_written = True
        loss = F.cross_entropy(logits.float(), y) * self.args.loss_mult
        if self.args.manual:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            return None
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.args.lr)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--loss-mult", type=float, default=1.0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--manual", action="store_true")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dtype-file")
    args = parser.parse_args()

    L.seed_everything(42)
    x = torch.randn(1024, 32)
    y = (x @ torch.randn(32, 4)).argmax(dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    trainer = Trainer(max_steps=args.max_steps, precision=args.precision, accumulate_grad_batches=args.accumulate,
                        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    trainer.fit(Net(args), loader)
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    scale = None if scaler is None else float(scaler.get_scale())
    print(f"precision={trainer.precision} scaler={type(scaler).__name__} scale={scale} steps={trainer.global_step}")


if __name__ == "__main__":
    main()
