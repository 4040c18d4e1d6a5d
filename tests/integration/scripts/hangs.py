"""Steps a few times, then hangs (a deadlocked data loader, say)."""

import time

import torch
import torch.nn as nn

import advisor

mp = advisor.load_policy()
model = mp.setup(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    with mp.autocast():
        loss = model(mp.to_device(torch.randn(16, 8))).float().pow(2).mean()
    mp.step(loss, opt)
time.sleep(3600)
