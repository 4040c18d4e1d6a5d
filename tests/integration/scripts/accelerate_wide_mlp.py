"""An unmodified Accelerate script that asks for fp32 (mixed_precision="no") and seeds itself.

A wide MLP, so that bf16 autocast is faster than fp32 on a CPU with AMX. ``--report DIR``
writes ``DIR/<mixed precision>.json`` with what the first training step ran in (Accelerate's
mixed precision, the dtype of the hidden Linear's output, the GradScaler's scale), and the same
line goes to stdout; ``--loss-mult`` multiplies the loss, so that fp16's scaled gradients
overflow and the GradScaler skips steps.
"""

import argparse
import json

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--accum", type=int, default=1)
parser.add_argument("--loss-mult", type=float, default=1.0)
parser.add_argument("--report", default=None)
args = parser.parse_args()

accelerator = Accelerator(mixed_precision="no", gradient_accumulation_steps=args.accum)
set_seed(42)
x = torch.randn(4096, 64)
y = (x @ torch.randn(64, 8)).argmax(dim=1)
model = nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                      nn.Linear(args.width, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch, shuffle=True)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

seen = {}


def record_dtype(module, inputs, output):
    seen.setdefault("dtype", str(output.dtype))


model[2].register_forward_hook(record_dtype)

step = 0
while step < args.steps:
    for xb, yb in loader:
        with accelerator.accumulate(model):
            loss = F.cross_entropy(model(xb), yb) * args.loss_mult
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step == 0 and accelerator.sync_gradients:
            report = {"mixed_precision": accelerator.mixed_precision, "hidden_dtype": seen["dtype"],
                      "loss_scale": None if accelerator.scaler is None else accelerator.scaler.get_scale()}
            print(json.dumps(report), flush=True)
            if args.report:
                with open(f"{args.report}/{accelerator.mixed_precision}.json", "w") as f:
                    json.dump(report, f)
        step += accelerator.sync_gradients
        if step >= args.steps:
            break
