"""Passes: a script with a learning-rate warm-up, whose loss barely moves at first.

AdamW's learning rate rises linearly from 0 to 3e-3 over the first 100 optimizer steps, then
stays. While it is tiny, the loss hardly moves in any mode; once it is large, every mode trains
as fp32 does, down to the plateau that 10% of noisy labels set. Pure bf16 loses the very first, smallest updates, which makes no lasting
difference.

Truth (scripts/verdict_truth.py: fp32 and each mode, 605 recorded steps, warm-up included, seed 0):
- bf16-mixed: stable. fp32 1.318 -> 0.4929, bf16-mixed 1.318 -> 0.4906; end ratio 0.995, fall ratio 1.
- bf16-true: stable. fp32 1.318 -> 0.4929, bf16-true 1.328 -> 0.4868; end ratio 0.988, fall ratio 1.02.
- fp16-mixed: stable. fp32 1.318 -> 0.4929, fp16-mixed 1.318 -> 0.4928; end ratio 1, fall ratio 1.
  mpadvise trial tests/verdicts/pass_lr_warmup.py -m bf16-mixed -m bf16-true -m fp16-mixed --steps 600 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
x = torch.randn(4096, 32)
clean = (x @ torch.randn(32, 4)).argmax(dim=1)
y = torch.where(torch.rand(4096) < 0.1, torch.randint(0, 4, (4096,)), clean)  # 10% noisy labels

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 4))
base_lr, warmup = 3e-3, 100
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=0.0))
batch = mp.micro_batch_size(64)
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    perm = torch.randperm(len(x))
    for i in range(0, len(x) - batch + 1, batch):
        for group in optimizer.param_groups:  # the warm-up, counted in optimizer steps
            group["lr"] = base_lr * min(1.0, (mp.optimizer_steps + 1) / warmup)
        xb, yb = mp.to_device(x[perm[i : i + batch]], y[perm[i : i + batch]])
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
