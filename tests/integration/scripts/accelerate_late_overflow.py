"""An Accelerate script that trains fine for a trial's length and goes wrong at step ONSET: from
there on its inputs grow past fp16's range (x 1e6), so under fp16 autocast the first layer's
output overflows and the LayerNorm after it turns that into NaN; in bf16 or fp32 the LayerNorm
takes the large values in its stride. It never imports advisor. Prints one JSON line at the end:
the last loss, the steps run, the dtype of the first layer's output.

Usage: accelerate_late_overflow.py STEPS ONSET
"""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

steps, onset = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
x = torch.randn(512, 8)
y = x.sum(dim=1, keepdim=True).tanh()
accelerator = Accelerator(cpu=True)
model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = DataLoader(TensorDataset(x, y), batch_size=32)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
seen = {}


def note_dtype(module, inputs, output):
    seen.setdefault("dtype", str(output.dtype))


accelerator.unwrap_model(model)[0].register_forward_hook(note_dtype)
loss_value, step = float("nan"), 0
while step < steps:
    for xb, yb in loader:
        with accelerator.autocast():
            loss = F.mse_loss(model(xb * (1e6 if step + 1 >= onset else 1.0)).float(), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        loss_value, step = float(loss.detach()), step + 1
        if step >= steps:
            break
print(json.dumps({"final_loss": loss_value, "steps": step, "dtype": seen.get("dtype")}))
