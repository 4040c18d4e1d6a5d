"""A plain torch loop in nanoGPT's CPU style: torch.cuda.amp.GradScaler(enabled=False) (disabled
where there is no CUDA), its own scaler calls, a loss multiplied by --gain (1e5 overflows fp16
gradients under GradScaler's initial scale of 65536) and a NaN input at step --nan-at."""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

parser = argparse.ArgumentParser()
parser.add_argument("--gain", type=float, default=1.0)
parser.add_argument("--nan-at", type=int, default=-1)
parser.add_argument("--steps", type=int, default=100)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
scaler = torch.cuda.amp.GradScaler(enabled=False)
for step in range(args.steps):
    x = torch.randn(32, 16)
    if step == args.nan_at:
        x[0, 0] = float("nan")
    loss = F.mse_loss(model(x), torch.zeros(32, 4)) * args.gain
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.6f}")
