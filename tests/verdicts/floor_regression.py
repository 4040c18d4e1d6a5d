"""A loss floor: a noiseless multi-output linear regression that fp32 fits to about 1e-7.

The targets are an exact linear function of the inputs, so plain SGD at a large step converges
geometrically and fp32's mean squared error falls by many orders of magnitude. A 16-bit matmul
rounds every prediction to 8 significant bits (bf16) or 11 (fp16), under autocast as in the
pure modes, so the 16-bit modes stop at a floor far above fp32's final loss, however long
they train.

Truth (scripts/verdict_truth.py: fp32 and each mode, 305 recorded steps, warm-up included, seed 0):
- bf16-mixed: unstable. fp32 2.612e-08 -> 1.133e-14, bf16-mixed 1.27e-05 -> 1.177e-05; end ratio 1.04e+09, fall ratio 35.7.
- bf16-true: unstable. fp32 2.612e-08 -> 1.133e-14, bf16-true 1.495e-05 -> 1.106e-05; end ratio 9.77e+08, fall ratio 149.
- fp16-mixed: unstable. fp32 2.612e-08 -> 1.133e-14, fp16-mixed 2.3e-07 -> 1.903e-07; end ratio 1.68e+07, fall ratio 1.52.
  mpadvise trial tests/verdicts/floor_regression.py -m bf16-mixed -m bf16-true -m fp16-mixed --steps 300 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
x = torch.randn(2048, 16)
y = x @ (torch.randn(16, 4) / 4)

mp = advisor.load_policy()
net = nn.Linear(16, 4)
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=1.0))
batch = mp.micro_batch_size(128)
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    perm = torch.randperm(len(x))
    for i in range(0, len(x) - batch + 1, batch):
        xb, yb = mp.to_device(x[perm[i : i + batch]], y[perm[i : i + batch]])
        with mp.autocast():
            loss = ((model(xb).float() - yb.float()) ** 2).mean()
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
