"""Passes: a classifier that converges within a few dozen steps, in every mode.

Three well-separated Gaussian clusters, with enough overlap that the loss settles near 0.1
rather than heading to zero. SGD with momentum (no eps to round away, no update too small for
16 bits) reaches the plateau within about 30 steps; every 16-bit mode, pure or mixed, gets
there with fp32 and stays there.

Truth (scripts/verdict_truth.py: fp32 and each mode, 305 recorded steps, warm-up included, seed 0):
- bf16-mixed: stable. fp32 0.4517 -> 0.2793, bf16-mixed 0.4501 -> 0.2763; end ratio 0.989, fall ratio 1.01.
- bf16-true: stable. fp32 0.4517 -> 0.2793, bf16-true 0.4504 -> 0.2776; end ratio 0.994, fall ratio 1.
- fp16-mixed: stable. fp32 0.4517 -> 0.2793, fp16-mixed 0.4516 -> 0.2756; end ratio 0.987, fall ratio 1.02.
- fp16-true: stable. fp32 0.4517 -> 0.2793, fp16-true 0.4516 -> 0.2751; end ratio 0.985, fall ratio 1.02.
  mpadvise trial tests/verdicts/pass_fast_classifier.py -m bf16-mixed -m bf16-true -m fp16-mixed -m fp16-true --steps 300 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
centres = 0.9 * torch.randn(3, 16)
y = torch.randint(0, 3, (3072,))
x = centres[y] + 1.5 * torch.randn(3072, 16)

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 3))
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9))
batch = mp.micro_batch_size(64)
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    perm = torch.randperm(len(x))
    for i in range(0, len(x) - batch + 1, batch):
        xb, yb = mp.to_device(x[perm[i : i + batch]], y[perm[i : i + batch]])
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
