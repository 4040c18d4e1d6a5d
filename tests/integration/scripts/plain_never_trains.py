"""A plain torch script that evaluates a model in a loop and never trains (no backward)."""

import sys
import time

import torch
import torch.nn as nn

model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if "--exit" in sys.argv:
    print(model(torch.randn(2, 8)).sum().item())
    raise SystemExit(0)
with torch.no_grad():
    while True:
        model(torch.randn(4, 8))
        time.sleep(0.05)
