"""A learning rate so large that even fp32 diverges: no verdict is possible."""

import torch
import torch.nn as nn

import advisor

torch.manual_seed(0)
mp = advisor.load_policy()
model = mp.setup(nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)))
opt = torch.optim.SGD(model.parameters(), lr=50.0)
x, y = torch.randn(256, 16), torch.randn(256, 1)
for _ in range(200):
    xb, yb = mp.to_device(x, y)
    with mp.autocast():
        loss = (model(xb).float() - yb).pow(2).mean()
    mp.step(loss, opt)
