"""A small regression trained with AdamW at lr 1e-5: updates are tiny next to the weights.

fp32, bf16-mixed and fp16-mixed keep fp32 master weights and track each other. Pure bf16
(8 mantissa bits) rounds most updates away and stalls; pure fp16 overflows AdamW's eps
(1e-8 rounds to 0 in fp16) and gives NaN.
"""

import sys

import torch
import torch.nn as nn

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
x = torch.randn(4096, 32)
w_true = torch.randn(32, 1) / 32**0.5
y = x @ w_true + 0.05 * torch.randn(4096, 1)

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(32, 1024), nn.Tanh(), nn.Linear(1024, 1))
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-5))
batch = mp.micro_batch_size(64)
for step in range(steps):
    i = (step * batch) % (len(x) - batch)
    xb, yb = mp.to_device(x[i : i + batch], y[i : i + batch])
    with mp.autocast():
        loss = ((model(xb).float() - yb.float()) ** 2).mean()
    mp.step(loss, optimizer)
