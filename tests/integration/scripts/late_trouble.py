"""Trains fine for a trial's length, then goes wrong at step ONSET (argv): the guard's subject.

Cases (argv[1]):
* ``overflow``: from ONSET on, inputs grow past fp16's range (x 1e6): under fp16 autocast the
  first layer's output overflows to inf, and the LayerNorm after it turns that into NaN; in
  bf16 or fp32 the LayerNorm takes the large values in its stride.
* ``collapse``: from ONSET on, the gradient of an fp16 activation is forced non-finite, so the
  GradScaler skips every step and its scale (started at 2) falls below 1.

Usage: late_trouble.py CASE STEPS ONSET; the policy comes from ``load_policy()`` (so from
``MPADVISE_POLICY``, ``MPADVISE_GUARD`` and the cache). Prints one JSON line at the end.
"""

from __future__ import annotations

import json
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

case, steps, onset = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.manual_seed(0)
x = torch.randn(512, 8)
y = x.sum(dim=1, keepdim=True).tanh()


class Net(nn.Module):
    """Linear, LayerNorm, Linear; in the collapse case an fp16 activation's gradient is forced to inf."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.norm, self.last = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1)
        self.force_inf = False

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden = self.first(inputs)
        if self.force_inf and hidden.dtype == torch.float16 and hidden.requires_grad:
            hidden.register_hook(lambda grad: grad * math.inf)
        return self.last(self.norm(hidden))


mp = advisor.load_policy()
net = Net()
model, optimizer = mp.setup(net, torch.optim.SGD(net.parameters(), lr=0.05))
batch = mp.micro_batch_size(32)
loss_value = float("nan")
while mp.optimizer_steps < steps:
    for start in range(0, len(x), batch):
        late = mp.optimizer_steps + 1 >= onset
        xb = x[start:start + batch] * (1e6 if case == "overflow" and late else 1.0)
        net.force_inf = case == "collapse" and late
        xb, yb = mp.to_device(xb, y[start:start + batch])
        with mp.autocast():
            loss = F.mse_loss(model(xb).float(), yb.float())
        mp.step(loss, optimizer)
        loss_value = float(loss.detach())
        if mp.optimizer_steps >= steps:
            break
applied = mp.optimizer_steps - mp.skipped_steps
print(json.dumps({"mode": mp.mode, "final_loss": loss_value, "optimizer_steps": mp.optimizer_steps,
                  "applied_steps": applied, "events": mp.guard.events and [e.to_dict() for e in mp.guard.events]}))
