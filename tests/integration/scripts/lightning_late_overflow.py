"""A Lightning Trainer script that trains fine for a trial's length and goes wrong at step ONSET:
from there on its inputs grow past fp16's range (x 1e6), so under fp16 autocast the first layer's
output overflows and the LayerNorm after it turns that into NaN; in bf16 or fp32 the LayerNorm
takes the large values in its stride. It never imports advisor. Prints one JSON line at the end:
the last loss, the training steps run, the dtype of the first layer's output.

Usage: lightning_late_overflow.py STEPS ONSET
"""

import json
import sys

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

steps, onset = int(sys.argv[1]), int(sys.argv[2])


class Net(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
        self.calls, self.last, self.seen = 0, float("nan"), None

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.calls += 1
        hidden = self.net[0](x * (1e6 if self.calls >= onset else 1.0))
        self.seen = self.seen or str(hidden.dtype)
        loss = F.mse_loss(self.net[2](self.net[1](hidden)).float(), y)
        self.last = float(loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


torch.manual_seed(0)
x = torch.randn(512, 8)
y = x.sum(dim=1, keepdim=True).tanh()
model = Net()
trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, precision="32-true", logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=32))
print(json.dumps({"final_loss": model.last, "steps": model.calls, "dtype": model.seen}))
