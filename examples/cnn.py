"""A small CNN that tells synthetic shapes apart (bars, crosses, boxes, dots), trained under the
policy mpadvise resolves.

    python examples/cnn.py
    mpadvise tune examples/cnn.py -- --epochs 2
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor


def make_shapes(n: int, size: int = 32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images of four shape classes at random positions, with noise: a task a CNN must learn."""
    g = torch.Generator().manual_seed(seed)
    images = 0.3 * torch.randn(n, 1, size, size, generator=g)
    labels = torch.randint(0, 4, (n,), generator=g)
    for i in range(n):
        r, c = torch.randint(4, size - 12, (2,), generator=g).tolist()
        k = int(labels[i])
        if k == 0:
            images[i, 0, r : r + 8, c + 3 : c + 5] += 1.5  # vertical bar
        elif k == 1:
            images[i, 0, r + 3 : r + 5, c : c + 8] += 1.5
            images[i, 0, r : r + 8, c + 3 : c + 5] += 1.5  # cross
        elif k == 2:
            images[i, 0, r : r + 8, c : c + 8] += 1.5
            images[i, 0, r + 2 : r + 6, c + 2 : c + 6] -= 1.5  # hollow box
        else:
            images[i, 0, r + 3 : r + 5, c + 3 : c + 5] += 3.0  # dot
    return images, labels


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(2 * channels, 2 * channels, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(2 * channels, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", help="apply this precision mode instead of the resolved policy")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--samples", type=int, default=2048)
    args = parser.parse_args()

    torch.manual_seed(0)
    images, labels = make_shapes(args.samples)
    dataset = torch.utils.data.TensorDataset(images, labels)

    mp = advisor.load_policy(advisor.Policy(mode=args.mode) if args.mode else None)
    net = SmallCNN(args.channels)
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr))
    loader = torch.utils.data.DataLoader(dataset, batch_size=mp.micro_batch_size(args.batch_size), shuffle=True)
    with mp:
        for epoch in range(args.epochs):
            total, correct, seen = 0.0, 0, 0
            for xb, yb in loader:
                xb, yb = mp.to_device(xb, yb)
                with mp.autocast():
                    logits = model(xb).float()
                    loss = F.cross_entropy(logits, yb)
                mp.step(loss, optimizer)
                total += loss.item() * len(yb)
                correct += int((logits.argmax(1) == yb).sum())
                seen += len(yb)
            print(f"epoch {epoch} loss {total / seen:.4f} accuracy {correct / seen:.3f}")


if __name__ == "__main__":
    main()
