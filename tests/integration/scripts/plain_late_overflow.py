"""A plain torch loop with its own autocast and GradScaler, no line of mpadvise, that trains fine
for a trial's length and goes wrong at step ONSET: from there on its inputs grow past fp16's
range (x 1e6), so under fp16 autocast the first layer's output overflows and the LayerNorm
after it turns that into NaN; in bf16 or fp32 the LayerNorm takes the large values in its
stride. Prints one JSON line at the end: the loss, the steps taken, the autocast dtype seen.

Usage: plain_late_overflow.py STEPS ONSET
"""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

steps, onset = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
x = torch.randn(512, 8)
y = x.sum(dim=1, keepdim=True).tanh()
model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
scaler = torch.amp.GradScaler("cpu", enabled=False)
seen = {}


def note_dtype(module, inputs, output):
    seen.setdefault("dtype", str(output.dtype))


model[0].register_forward_hook(note_dtype)
loss_value, step = float("nan"), 0
while step < steps:
    for start in range(0, len(x), 32):
        xb = x[start:start + 32] * (1e6 if step + 1 >= onset else 1.0)
        with torch.autocast("cpu", enabled=False):
            loss = F.mse_loss(model(xb).float(), y[start:start + 32])
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        loss_value, step = float(loss), step + 1
        if step >= steps:
            break
print(json.dumps({"final_loss": loss_value, "steps": step, "dtype": seen.get("dtype")}))
