"""fp16 gradient underflow without loss scaling: a loss weighted by 1e-5 gives gradients
below fp16's smallest subnormal value (2^-24, about 6e-8), which flush to zero.

The script weights its loss by 1e-5 (as a loss summed over many terms and then normalised by
a large constant would be) and compensates with SGD's learning rate, so fp32 trains normally.
Pure fp16 runs the backward in fp16 with no loss scale: the gradients of the outputs are about
1e-7 times the error, so they flush to zero as soon as the error is small and the loss stops
falling far above fp32's. fp16-mixed multiplies the loss by its GradScaler's scale (2^16)
before the backward and trains as fp32 does; bf16 has fp32's exponent range and does not
underflow.

Truth (scripts/verdict_truth.py: fp32 and each mode, 405 recorded steps, warm-up included, seed 0):
- fp16-true: unstable. fp32 5.616e-07 -> 2.135e-09, fp16-true 6.858e-07 -> 4.956e-07; end ratio 232, fall ratio 0.34.
- fp16-mixed: stable. fp32 5.616e-07 -> 2.135e-09, fp16-mixed 5.616e-07 -> 2.132e-09; end ratio 0.998, fall ratio 1.
- bf16-mixed: stable. fp32 5.616e-07 -> 2.135e-09, bf16-mixed 5.607e-07 -> 2.221e-09; end ratio 1.04, fall ratio 0.998.
  mpadvise trial tests/verdicts/underflow_fp16_tiny_gradients.py -m fp16-true -m fp16-mixed -m bf16-mixed --steps 400 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
x = torch.randn(4096, 16)
y = torch.tanh(x @ torch.randn(16, 4) / 4) + 0.01 * torch.randn(4096, 4)

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=2e4, momentum=0.9))
batch = mp.micro_batch_size(64)
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    perm = torch.randperm(len(x))
    for i in range(0, len(x) - batch + 1, batch):
        xb, yb = mp.to_device(x[perm[i : i + batch]], y[perm[i : i + batch]])
        with mp.autocast():
            loss = 1e-5 * ((model(xb).float() - yb.float()) ** 2).mean()
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
