"""A small MLP classifier on synthetic data, trained with Accelerate; it never imports mpadvise.

    python examples/accelerate_mlp.py                              # as written: mixed_precision="no"
    mpadvise trial examples/accelerate_mlp.py --mode bf16-mixed    # fp32 against bf16-mixed, side by side
    mpadvise tune examples/accelerate_mlp.py                       # the fastest stable precision for it
    mpadvise run examples/accelerate_mlp.py                        # trains under the tuned policy
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixed-precision", default="no", help="Accelerate's mixed_precision")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.accum)
    set_seed(42)
    x = torch.randn(args.samples, 256)
    teacher = torch.randn(256, 16)
    y = (torch.tanh(x @ teacher) @ torch.randn(16, 10)).argmax(dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size,
                                         shuffle=True)
    model = nn.Sequential(nn.Linear(256, args.width), nn.GELU(), nn.Linear(args.width, args.width), nn.GELU(),
                          nn.Linear(args.width, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    step = 0
    while step < args.steps:
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            step += accelerator.sync_gradients
            if step >= args.steps:
                break
    print(f"trained {step} steps with mixed_precision={accelerator.mixed_precision!r} "
          f"on {accelerator.device}, final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
