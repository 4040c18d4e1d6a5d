"""A tiny classifier: trains fine in every mode; the quick subject of trial tests."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
x = torch.randn(1024, 32)
y = (x @ torch.randn(32, 4)).argmax(dim=1)
mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=3e-3))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=mp.micro_batch_size(32), shuffle=True)
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    for xb, yb in loader:
        xb, yb = mp.to_device(xb, yb)
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
