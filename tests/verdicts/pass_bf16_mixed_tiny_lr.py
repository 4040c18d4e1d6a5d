"""Passes in bf16-mixed: a tiny learning rate is harmless when the master weights are fp32.

A wide classifier trained with AdamW at lr 2e-5, as in fine-tuning: every weight moves by
about 2e-5 per step, and the loss falls steadily only because many weights move together.
bf16-mixed and fp16-mixed compute the forward in 16 bits but add each small update to fp32
weights, so they keep every update and track fp32.

Truth (scripts/verdict_truth.py: fp32 and each mode, 605 recorded steps, warm-up included, seed 0):
- bf16-mixed: stable. fp32 2.35 -> 2.092, bf16-mixed 2.35 -> 2.092; end ratio 1, fall ratio 1.
- fp16-mixed: stable. fp32 2.35 -> 2.092, fp16-mixed 2.35 -> 2.092; end ratio 1, fall ratio 1.
  mpadvise trial tests/verdicts/pass_bf16_mixed_tiny_lr.py -m bf16-mixed -m fp16-mixed --steps 600 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
x = torch.randn(4096, 64)
y = (x @ torch.randn(64, 10)).argmax(dim=1)

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=2e-5))
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
