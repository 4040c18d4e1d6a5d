"""fp16 overflow: raw, unnormalised inputs (readings in the hundreds of thousands) make the
first layer's outputs exceed fp16's largest value, 65504.

A LayerNorm right after the first layer makes the network indifferent to the inputs' scale,
so fp32 trains normally, and so do the bf16 modes (bf16 has fp32's exponent range). In fp16,
pure or under autocast, the first matmul overflows to inf on every batch: pure fp16's loss is
NaN from the first step, and fp16-mixed's GradScaler skips every step (a loss scale cannot
help an overflow in the forward pass), so it never trains.

Truth (scripts/verdict_truth.py: fp32 and each mode, 405 recorded steps, warm-up included, seed 0):
- fp16-mixed: unstable. fp32 1.272 -> 0.1569, fp16-mixed nan -> nan; end ratio nan, fall ratio nan, 405 non-finite from step 1.
- fp16-true: unstable. fp32 1.272 -> 0.1569, fp16-true nan -> nan; end ratio nan, fall ratio nan, 405 non-finite from step 1.
- bf16-mixed: stable. fp32 1.272 -> 0.1569, bf16-mixed 1.272 -> 0.1568; end ratio 0.999, fall ratio 1.
  mpadvise trial tests/verdicts/overflow_fp16_large_activations.py -m fp16-mixed -m fp16-true -m bf16-mixed --steps 400 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
x = torch.randn(4096, 16)
y = (x @ torch.randn(16, 4)).argmax(dim=1)
x = 3e5 * x  # raw readings, never normalised

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-3))
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
