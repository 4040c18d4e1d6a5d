"""A small MLP classifier on synthetic data, trained under the policy mpadvise resolves.

    python examples/mlp.py                     # the policy load_policy() resolves
    python examples/mlp.py --mode bf16-mixed   # a mode applied by hand
    mpadvise tune examples/mlp.py              # find the fastest stable policy for it
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", help="apply this precision mode instead of the resolved policy")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    torch.manual_seed(0)
    x = torch.randn(args.samples, 256)
    teacher = torch.randn(256, 16)
    y = (torch.tanh(x @ teacher) @ torch.randn(16, 10)).argmax(dim=1)
    dataset = torch.utils.data.TensorDataset(x, y)

    mp = advisor.load_policy(advisor.Policy(mode=args.mode) if args.mode else None)
    net = nn.Sequential(
        nn.Linear(256, args.width), nn.GELU(),
        nn.Linear(args.width, args.width), nn.GELU(),
        nn.Linear(args.width, 10),
    )
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr))
    loader = torch.utils.data.DataLoader(dataset, batch_size=mp.micro_batch_size(args.batch_size), shuffle=True)
    with mp:
        for epoch in range(args.epochs):
            total, count = 0.0, 0
            for xb, yb in loader:
                xb, yb = mp.to_device(xb, yb)
                with mp.autocast():
                    loss = F.cross_entropy(model(xb).float(), yb)
                mp.step(loss, optimizer)
                total, count = total + loss.item(), count + 1
            print(f"epoch {epoch} loss {total / count:.4f}")


if __name__ == "__main__":
    main()
