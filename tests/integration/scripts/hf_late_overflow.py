"""A Hugging Face Trainer script that trains fine for a trial's length and goes wrong at step
ONSET, only under autocast: from there on its forward turns NaN in 16-bit, as an overflow would
(the Trainer takes fp16 on a GPU only, so on a CPU the 16-bit mode is bf16-mixed); in fp32 it
stays finite. It never imports advisor. Prints one JSON line at the end: the last loss, the
steps run, the dtype of the first layer's output.

Usage: hf_late_overflow.py STEPS ONSET
"""

import json
import os
import sys
import tempfile

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments

steps, onset = int(sys.argv[1]), int(sys.argv[2])


class TinyConfig(PretrainedConfig):
    model_type = "tiny-late-overflow"


class Tiny(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 1))
        self.calls, self.last, self.seen = 0, float("nan"), None
        self.post_init()

    def forward(self, x, labels=None):
        if self.training:
            self.calls += 1
        if self.training and self.calls >= onset and torch.is_autocast_enabled(x.device.type):
            x = x * float("nan")
        hidden = self.net[0](x)
        self.seen = self.seen or str(hidden.dtype)
        loss = F.mse_loss(self.net[2](self.net[1](hidden)).float(), labels)
        self.last = float(loss.detach())
        return {"loss": loss}


class Points(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(512, 8, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True).tanh()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


torch.manual_seed(0)
model = Tiny(TinyConfig())
with tempfile.TemporaryDirectory() as out:
    args = TrainingArguments(output_dir=os.path.join(out, "run"), per_device_train_batch_size=32, max_steps=steps,
                             learning_rate=0.05, optim="sgd", lr_scheduler_type="constant", report_to="none",
                             save_strategy="no", logging_strategy="no", use_cpu=True)
    Trainer(model=model, args=args, train_dataset=Points()).train()
print(json.dumps({"final_loss": model.last, "steps": model.calls, "dtype": model.seen}))
