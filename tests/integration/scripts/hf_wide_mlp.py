"""An unmodified Hugging Face Trainer script: a wide MLP (a PreTrainedModel built from its
config) on an in-memory dataset. It never imports advisor.

Options make it misbehave on purpose: ``--precision`` passes an explicit precision to
TrainingArguments (which a trial must override); ``--nan-at K`` makes the K-th training
forward under autocast produce NaN; ``--loss-multiplier`` makes fp16 gradients overflow (so
the GradScaler skips steps). ``--emulate-gpu-fp16`` gives the Accelerator, on this CPU, the
fp16 autocast and GradScaler that Accelerate builds only on GPUs: the one fake, at the CUDA
boundary, so that fp16 steps can be recorded on a machine without one. At the end it prints
what its Trainer ran with.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.nn as nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments, set_seed


class WideConfig(PretrainedConfig):
    model_type = "wide-mlp"

    def __init__(self, features: int = 64, width: int = 1024, depth: int = 4, classes: int = 8, **kwargs):
        super().__init__(**kwargs)
        self.features, self.width, self.depth, self.classes = features, width, depth, classes


class WideMlp(PreTrainedModel):
    config_class = WideConfig

    def __init__(self, config: WideConfig, nan_at: int = 0, loss_multiplier: float = 1.0):
        super().__init__(config)
        layers: list[nn.Module] = [nn.Linear(config.features, config.width), nn.GELU()]
        for _ in range(config.depth - 1):
            layers += [nn.Linear(config.width, config.width), nn.GELU()]
        layers.append(nn.Linear(config.width, config.classes))
        self.body = nn.Sequential(*layers)
        self.nan_at, self.loss_multiplier, self.forwards = nan_at, loss_multiplier, 0
        self.post_init()

    def forward(self, x, labels=None):
        if self.training:
            self.forwards += 1
            # Only in 16-bit, as an fp16 overflow would: the fp32 reference stays finite.
            if self.forwards == self.nan_at and torch.is_autocast_enabled(x.device.type):
                x = x * float("nan")
        logits = self.body(x)
        loss = nn.functional.cross_entropy(logits.float(), labels) * self.loss_multiplier
        return {"loss": loss, "logits": logits}


class Points(torch.utils.data.Dataset):
    """Points labelled by a fixed random linear map: learnable in a few dozen steps."""

    def __init__(self, n: int, features: int, classes: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, features, generator=g)
        self.y = (self.x @ torch.randn(features, classes, generator=g)).argmax(dim=1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def emulate_gpu_fp16() -> None:
    """What Accelerate does for fp16 on a GPU, done on this CPU (accelerate/accelerator.py skips
    the CPU when it builds fp16 autocast and the GradScaler)."""
    from accelerate import Accelerator

    original = Accelerator.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if self.state.mixed_precision == "fp16" and self.device.type == "cpu":
            self.native_amp = True
            self.scaler = torch.amp.GradScaler("cpu")

    Accelerator.__init__ = __init__


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--accum", type=int, default=1)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default=None)
    parser.add_argument("--nan-at", type=int, default=0)
    parser.add_argument("--loss-multiplier", type=float, default=1.0)
    parser.add_argument("--emulate-gpu-fp16", action="store_true")
    opts = parser.parse_args()
    if opts.emulate_gpu_fp16:
        emulate_gpu_fp16()
    set_seed(42)
    config = WideConfig(width=opts.width, depth=opts.depth)
    model = WideMlp(config, nan_at=opts.nan_at, loss_multiplier=opts.loss_multiplier)
    precision = {"fp32": {"bf16": False, "fp16": False}, "bf16": {"bf16": True}, "fp16": {"fp16": True}}
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=os.path.join(out, "run"), per_device_train_batch_size=opts.batch,
            gradient_accumulation_steps=opts.accum, max_steps=opts.max_steps, learning_rate=opts.lr,
            logging_steps=10, report_to="none", save_strategy="no",
            **precision.get(opts.precision, {}),
        )
        trainer = Trainer(model=model, args=args, train_dataset=Points(8192, config.features, config.classes))
        trainer.train()
        print(f"hf-run mixed_precision={trainer.accelerator.mixed_precision} bf16={args.bf16} fp16={args.fp16} "
              f"per_device_train_batch_size={args.per_device_train_batch_size} "
              f"gradient_accumulation_steps={args.gradient_accumulation_steps}", flush=True)


if __name__ == "__main__":
    main()
