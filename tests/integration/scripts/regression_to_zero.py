"""A noiseless linear regression that fp32 fits almost exactly: its loss heads towards zero.

The target is an exact linear function of the input, so plain SGD converges geometrically and
fp32's mean squared error falls by eight orders of magnitude within 200 steps. A 16-bit matmul
rounds every prediction to 8 significant bits (bf16), in pure bf16 and under bf16 autocast
alike, so those modes stop at a loss floor thousands of times above fp32's final loss.
"""

import sys

import torch
import torch.nn as nn

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 400
x = torch.randn(2048, 32)
y = x @ (torch.randn(32, 1) / 32**0.5)

mp = advisor.load_policy()
net = nn.Linear(32, 1)
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.03))
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
