"""Trains fine for a trial's length, then stalls under pure bf16 after a learning-rate decay at
step ONSET (argv): the guard's subject for updates lost to rounding.

A noisy linear regression (weights about 0.25, label noise 0.5) trained with SGD whose learning
rate drops from 0.05 to 0.0005 at ONSET. Before the drop each update is larger than half of
bf16's spacing at the weight (2^-10 near 0.25), so bf16-true trains as fp32 does; after it each
update is about a hundredth of that and is rounded away, so the weights stop where the large
learning rate left them, while in fp32 and bf16-mixed (fp32 master weights) they keep settling.

Usage: late_stall.py STEPS ONSET; the policy comes from ``load_policy()``. Prints one JSON line
at the end, as late_trouble.py does.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn as nn

import advisor

steps, onset = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
dim, batch_size = 8, 64
x = torch.randn((steps + 1) * batch_size, dim)
y = x @ (0.25 * torch.randn(dim, 1)) + 0.5 * torch.randn((steps + 1) * batch_size, 1)

mp = advisor.load_policy()
net = nn.Linear(dim, 1, bias=False)
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
batch = mp.micro_batch_size(batch_size)
i, loss_value = 0, float("nan")
while mp.optimizer_steps < steps:
    if mp.optimizer_steps + 1 == onset:
        for group in optimizer.param_groups:
            group["lr"] = 0.0005
    xb, yb = mp.to_device(x[i:i + batch], y[i:i + batch])
    i += batch
    with mp.autocast():
        loss = ((model(xb).float() - yb.float()) ** 2).mean()
    mp.step(loss, optimizer)
    loss_value = float(loss.detach())
applied = mp.optimizer_steps - mp.skipped_steps
print(json.dumps({"mode": mp.mode, "final_loss": loss_value, "optimizer_steps": mp.optimizer_steps,
                  "applied_steps": applied, "events": mp.guard.events and [e.to_dict() for e in mp.guard.events]}))
