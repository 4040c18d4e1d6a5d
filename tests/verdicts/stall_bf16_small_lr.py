"""Pure bf16 stalls at a small learning rate: AdamW at lr 1e-5 on a 256-wide MLP regression.

Adam moves every weight by about lr (1e-5) per step, far less than half of bf16's spacing at a
weight of typical size (0.1 has a spacing of 2^-11, about 5e-4), so pure bf16 rounds nearly
every update away and its loss barely moves. bf16-mixed keeps fp32 master weights and tracks fp32.

Truth (scripts/verdict_truth.py: fp32 and each mode, 605 recorded steps, warm-up included, seed 0):
- bf16-true: unstable. fp32 1.276 -> 0.8641, bf16-true 1.311 -> 1.293; end ratio 1.5, fall ratio 0.0435.
- bf16-mixed: stable. fp32 1.276 -> 0.8641, bf16-mixed 1.275 -> 0.8641; end ratio 1, fall ratio 0.999.
  mpadvise trial tests/verdicts/stall_bf16_small_lr.py -m bf16-true -m bf16-mixed --steps 600 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
x = torch.randn(4096, 32)
w_true = torch.randn(32, 1) / 32**0.5
y = x @ w_true + 0.05 * torch.randn(4096, 1)

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 1))
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-5))
batch = mp.micro_batch_size(64)
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    perm = torch.randperm(len(x))
    for i in range(0, len(x) - batch + 1, batch):
        xb, yb = mp.to_device(x[perm[i : i + batch]], y[perm[i : i + batch]])
        with mp.autocast():
            loss = ((model(xb).float() - yb.float()) ** 2).mean()
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
