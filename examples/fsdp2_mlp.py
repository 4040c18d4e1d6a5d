"""An MLP classifier trained with FSDP2 (``fully_shard``) under the tuned policy.

    python examples/fsdp2_mlp.py                                 # one process
    torchrun --nproc-per-node 2 examples/fsdp2_mlp.py            # two processes (gloo on a CPU, nccl on GPUs)
    mpadvise tune --nproc-per-node 2 examples/fsdp2_mlp.py -- --steps 60
                                                                 # also searches the gradient reduction dtype

The order matters: ``mp.setup(model)`` converts the bare model for the precision mode, then
every block and the root are sharded with ``mp.fsdp_mixed_precision()`` (the policy's
MixedPrecisionPolicy: which dtype FSDP2 computes and reduces gradients in), and only then is
the optimizer built, on the sharded parameters. The forward still runs in ``mp.autocast()``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import advisor


class Mlp(nn.Module):
    """A stack of residual blocks, each one a unit that FSDP2 gathers and frees in turn."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.embed = nn.Linear(256, width)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def init_process_group(device: torch.device) -> None:
    """Join torchrun's process group, or make a group of one for a plain ``python`` run."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if "RANK" in os.environ:
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="samples per process and step")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    # The data and, outside a trial, the initial weights are the same on every process: FSDP2
    # shards each process's own copy of the model.
    torch.manual_seed(0)
    x = torch.randn(args.samples, 256)
    y = (torch.tanh(x @ torch.randn(256, 16)) @ torch.randn(16, 10)).argmax(dim=1)
    dataset = TensorDataset(x, y)

    mp = advisor.load_policy()  # each process applies the same policy, on its own device
    init_process_group(mp.device)
    model = mp.setup(Mlp(args.width, args.depth))
    mixed_precision = mp.fsdp_mixed_precision()
    for block in model.blocks:
        fully_shard(block, mp_policy=mixed_precision)
    fully_shard(model, mp_policy=mixed_precision)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # Each process reads its own share; the seed (a trial's, under mpadvise) orders the data.
    sampler = DistributedSampler(dataset, seed=torch.initial_seed() % 2**31, drop_last=True)
    loader = DataLoader(dataset, batch_size=mp.micro_batch_size(args.batch_size), sampler=sampler, drop_last=True)
    epoch = 0
    with mp:
        while mp.optimizer_steps < args.steps:
            sampler.set_epoch(epoch)
            for xb, yb in loader:
                xb, yb = mp.to_device(xb, yb)
                with mp.autocast():
                    loss = F.cross_entropy(model(xb).float(), yb)
                mp.step(loss, optimizer)
                if mp.optimizer_steps >= args.steps:
                    break
            epoch += 1
    if dist.get_rank() == 0:
        print(f"{mp.optimizer_steps} steps on {dist.get_world_size()} processes, last loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
