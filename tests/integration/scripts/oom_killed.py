"""Trains a step, then takes memory 64 MiB at a time until the kernel's OOM killer ends it.

Meant to run inside a memory cgroup with a small limit (the OOM test makes one). It stops by
itself after taking ``sys.argv[1]`` bytes (3 GiB by default), so that outside such a cgroup it
cannot take the machine's memory.
"""

import sys

import torch
import torch.nn as nn

import advisor

most = int(sys.argv[1]) if len(sys.argv) > 1 else 3 * 2**30
mp = advisor.load_policy()
model = mp.setup(nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with mp.autocast():
    loss = model(mp.to_device(torch.randn(16, 8))).float().pow(2).mean()
mp.step(loss, opt)
blocks = []
while len(blocks) * 2**26 < most:
    blocks.append(torch.ones(2**26, dtype=torch.uint8))  # filled, so every page is resident
print(f"took {len(blocks) * 64} MiB and was not killed", file=sys.stderr)
