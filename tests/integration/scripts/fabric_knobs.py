"""A Lightning Fabric script with knobs for the adapter's tests: an explicit precision, a loss
multiplier (to make fp16 overflow) and accumulation; it never imports advisor.

Writes the dtype of its first training forward's logits to --dtype-file (appending), and at the
end prints what precision Fabric ended up with and its loss scaler.
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--loss-mult", type=float, default=1.0)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dtype-file")
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=1, precision=args.precision)
    fabric.seed_everything(42)
    x = torch.randn(1024, 32)
    y = (x @ torch.randn(32, 4)).argmax(dim=1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch_size, shuffle=True)
    net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    # Fabric's autocast is on inside the model's forward only; its outputs come back as fp32.
    first_layer_dtypes: list[torch.dtype] = []
    net[0].register_forward_hook(lambda module, inputs, output: first_layer_dtypes.append(output.dtype))
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=args.lr))
    loader = fabric.setup_dataloaders(loader)
    steps, micro, dtype_written = 0, 0, False
    while steps < args.max_steps:
        for xb, yb in loader:
            micro += 1
            accumulating = micro % args.accumulate != 0
            with fabric.no_backward_sync(model, enabled=accumulating):
                logits = model(xb)
                if args.dtype_file and not dtype_written:
                    with open(args.dtype_file, "a") as f:
                        f.write(f"{first_layer_dtypes[0]}\n")
                    dtype_written = True
                loss = F.cross_entropy(logits.float(), yb) * args.loss_mult
                fabric.backward(loss / args.accumulate)
            if accumulating:
                continue
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
            if steps >= args.max_steps:
                break
    scaler = getattr(fabric.strategy.precision, "scaler", None)
    scale = None if scaler is None else float(scaler.get_scale())
    print(f"precision={fabric.strategy.precision.precision} scaler={type(scaler).__name__} scale={scale} steps={steps}")


if __name__ == "__main__":
    main()
