"""A late, finite divergence: once the learning rate decays, pure bf16 stops following a
target that drifts slowly, and its loss climbs again.

An online linear regression on a stream whose true weights move a little every step (a
drifting target, as in forecasting or continual training), trained with SGD whose learning
rate drops from 0.05 to 0.02 after 100 steps. fp32 follows the target with a small lag
throughout. Pure bf16 follows it while the learning rate is large; after the drop each update
(lr times a small gradient) is less than half of bf16's spacing at the weight (2^-7 near 1)
and is rounded away. The weights stop moving while the target keeps moving, and the loss,
after falling with fp32's, climbs again, finitely, to several times fp32's. bf16-mixed and
fp16-mixed keep fp32 master weights and follow the target as fp32 does.

Truth (scripts/verdict_truth.py: fp32 and each mode, 605 recorded steps, warm-up included, seed 0):
- bf16-true: unstable. fp32 0.02273 -> 0.001809, bf16-true 0.02145 -> 0.01387; end ratio 7.67, fall ratio 0.362.
- bf16-mixed: stable. fp32 0.02273 -> 0.001809, bf16-mixed 0.02248 -> 0.001862; end ratio 1.03, fall ratio 0.985.
- fp16-mixed: stable. fp32 0.02273 -> 0.001809, fp16-mixed 0.04174 -> 0.001811; end ratio 1, fall ratio 1.91.
  mpadvise trial tests/verdicts/climb_bf16_drifting_target.py -m bf16-true -m bf16-mixed -m fp16-mixed --steps 600 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
dim, batch_size = 8, 64
x = torch.randn(steps + 1, batch_size, dim)
start = torch.randn(dim)
drift = 2e-4 * torch.randn(dim).sign()  # each true weight moves by 2e-4 per step
w_true = start + torch.arange(steps + 1).unsqueeze(1) * drift  # (steps + 1, dim)
y = torch.einsum("sbd,sd->sb", x, w_true).unsqueeze(-1) + 0.04 * torch.randn(steps + 1, batch_size, 1)
x, y = x.flatten(0, 1), y.flatten(0, 1)  # one stream, served in order

mp = advisor.load_policy()
net = nn.Linear(dim, 1, bias=False)
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
batch = mp.micro_batch_size(batch_size)
i = 0
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    if mp.optimizer_steps == 100:  # the learning-rate decay
        for group in optimizer.param_groups:
            group["lr"] = 0.02
    xb, yb = mp.to_device(x[i : i + batch], y[i : i + batch])
    i += batch
    with mp.autocast():
        loss = ((model(xb).float() - yb.float()) ** 2).mean()
    mp.step(loss, optimizer)
