"""A two-layer network trained by hand: gradients from autograd, updates without an optimizer.

Plain PyTorch, no torch.optim and no mpadvise: each step is one backward and one update of the
parameters in place under ``torch.no_grad()``. ``mpadvise tune`` counts one step per backward
and update:

    python examples/plain_manual.py
    mpadvise tune examples/plain_manual.py
"""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--batch-size", type=int, default=128)
args = parser.parse_args()

torch.manual_seed(0)
teacher = torch.randn(32, 1)
model = nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 1))

for step in range(args.steps):
    xb = torch.randn(args.batch_size, 32)
    yb = torch.sin(xb @ teacher)
    loss = ((model(xb).float() - yb) ** 2).mean()
    loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= args.lr * p.grad
            p.grad = None
    print(f"step {step} loss {loss.item():.6f}")
