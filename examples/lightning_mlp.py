"""A small MLP classifier on synthetic data, trained with Lightning's Trainer; it never imports mpadvise.

    python examples/lightning_mlp.py                            # as written: precision 32-true
    mpadvise trial examples/lightning_mlp.py --mode bf16-mixed  # fp32 against bf16-mixed, side by side
    mpadvise tune examples/lightning_mlp.py                     # the fastest stable precision for it
    mpadvise run examples/lightning_mlp.py                      # trains under the tuned policy
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(L.LightningModule):
    """Three linear layers with GELU between them."""

    def __init__(self, width: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Linear(256, width), nn.GELU(),
            nn.Linear(width, width), nn.GELU(),
            nn.Linear(width, 10),
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x).float(), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="32-true", help="Lightning's precision string")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    L.seed_everything(42)
    x = torch.randn(args.samples, 256)
    teacher = torch.randn(256, 16)
    y = (torch.tanh(x @ teacher) @ torch.randn(16, 10)).argmax(dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size,
                                         shuffle=True)

    trainer = L.Trainer(max_steps=args.max_steps, precision=args.precision, accelerator="auto", devices=1,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False)
    trainer.fit(MLP(args.width, args.lr), loader)
    print(f"trained {trainer.global_step} steps with precision {trainer.precision}")


if __name__ == "__main__":
    main()
