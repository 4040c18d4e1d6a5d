"""Pure fp16 with AdamW's default eps: 1e-8 is below fp16's smallest subnormal value (about
6e-8) and becomes 0, so Adam's denominator sqrt(v) + eps can be exactly 0: inf and NaN.

In pure fp16 the optimizer state is fp16 too. A gradient entry below about 2.4e-4 squares to
less than 6e-8 and its second moment v flushes to 0; with eps gone, the update m / (sqrt(v) +
eps) is m / 0 = inf (or 0 / 0 = NaN), the weight becomes inf or NaN and the loss is NaN from
the second step on. With eps=1e-4 (representable in fp16) the same script trains in pure fp16
as fp32 does. fp16-mixed and bf16-mixed keep fp32 weights and optimizer state and train as fp32
does.

Truth (scripts/verdict_truth.py: fp32 and each mode, 405 recorded steps, warm-up included, seed 0):
- fp16-true: unstable. fp32 1.326 -> 0.2376, fp16-true 1.529 -> nan; end ratio nan, fall ratio nan, 404 non-finite from step 2.
- fp16-mixed: stable. fp32 1.326 -> 0.2376, fp16-mixed 1.326 -> 0.2375; end ratio 1, fall ratio 1.
  mpadvise trial tests/verdicts/nan_fp16_adamw_eps.py -m fp16-true -m fp16-mixed --steps 400 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
x = torch.randn(2048, 16)
y = (x @ torch.randn(16, 4)).argmax(dim=1)

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3, eps=1e-8))
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
