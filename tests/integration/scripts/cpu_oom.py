"""Asks the allocator for far more memory than exists, after a first step."""

import torch
import torch.nn as nn

import advisor

mp = advisor.load_policy()
model = mp.setup(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with mp.autocast():
    loss = model(mp.to_device(torch.randn(16, 8))).float().pow(2).mean()
mp.step(loss, opt)
huge = torch.empty(2**50, dtype=torch.uint8)
