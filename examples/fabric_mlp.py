"""A small MLP classifier on synthetic data, trained with Lightning Fabric; it never imports mpadvise.

    python examples/fabric_mlp.py                            # as written: precision 32-true
    mpadvise trial examples/fabric_mlp.py --mode bf16-mixed  # fp32 against bf16-mixed, side by side
    mpadvise tune examples/fabric_mlp.py                     # the fastest stable precision for it
    mpadvise run examples/fabric_mlp.py                      # trains under the tuned policy
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="32-true", help="Lightning's precision string")
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="auto", devices=1, precision=args.precision)
    fabric.seed_everything(42)
    x = torch.randn(args.samples, 256)
    teacher = torch.randn(256, 16)
    y = (torch.tanh(x @ teacher) @ torch.randn(16, 10)).argmax(dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size,
                                         shuffle=True)

    net = nn.Sequential(
        nn.Linear(256, args.width), nn.GELU(),
        nn.Linear(args.width, args.width), nn.GELU(),
        nn.Linear(args.width, 10),
    )
    model, optimizer = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr))
    loader = fabric.setup_dataloaders(loader)
    step = 0
    while step < args.max_steps:
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb).float(), yb)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if step >= args.max_steps:
                break
    print(f"trained {step} steps with precision {fabric.strategy.precision.precision}")


if __name__ == "__main__":
    main()
