"""An MLP classifier trained by a plain PyTorch loop with no precision code at all.

No autocast, no GradScaler, no mpadvise: what most training scripts look like. ``mpadvise
tune`` applies each candidate precision to it from the outside:

    python examples/plain_mlp.py
    mpadvise tune examples/plain_mlp.py -- --epochs 2
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--samples", type=int, default=2048)
args = parser.parse_args()

torch.manual_seed(0)
x = torch.randn(args.samples, 64)
y = (torch.tanh(x @ torch.randn(64, 16)) @ torch.randn(16, 10)).argmax(dim=1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)

model = nn.Sequential(nn.Linear(64, args.width), nn.GELU(), nn.Linear(args.width, args.width), nn.GELU(),
                      nn.Linear(args.width, 10))
optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

step = 0
for _epoch in range(args.epochs):
    for xb, yb in loader:
        loss = F.cross_entropy(model(xb), yb)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")
        step += 1
