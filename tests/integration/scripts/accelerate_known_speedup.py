"""An unmodified Accelerate script with a known speed-up: each step does half its extra work under bf16.

Every optimizer step trains a small MLP through Accelerate (so the loss curves compare as
usual) and then multiplies fixed fp32 matrices: ``--work`` times when Accelerate runs
``mixed_precision="no"``, half as often under any other. The script never imports mpadvise;
it reads only its own Accelerator, as a script that sizes its work by precision would. The
ratio of the two step times holds on any CPU and under any steady load, since both share the
cores alike, whatever this CPU's bf16 does: what a check that `mpadvise trial`, `mpadvise
tune` and a plain start-up-free measurement agree needs (``scripts/bench_agreement.py
accelerate-known``).

    python accelerate_known_speedup.py --mixed-precision bf16 --steps 300
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
    parser.add_argument("--work", type=int, default=16, help="fp32 matmuls per step under mixed_precision='no'")
    parser.add_argument("--size", type=int, default=256, help="side of the fixed matrices")
    args = parser.parse_args()

    # One thread: a step's time then follows its share of the cores smoothly under load.
    torch.set_num_threads(1)
    accelerator = Accelerator(mixed_precision=args.mixed_precision)
    set_seed(42)
    x = torch.randn(2048, 32)
    y = (x @ torch.randn(32, 4)).argmax(dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=64, shuffle=True)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    generator = torch.Generator().manual_seed(1)
    a = torch.randn(args.size, args.size, generator=generator)
    b = torch.randn(args.size, args.size, generator=generator)
    work = args.work if accelerator.mixed_precision == "no" else args.work // 2

    step = 0
    while step < args.steps:
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            for _ in range(work):
                torch.mm(a, b)
            step += 1
            if step >= args.steps:
                break
    print(f"trained {step} steps with mixed_precision={accelerator.mixed_precision!r}, final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
