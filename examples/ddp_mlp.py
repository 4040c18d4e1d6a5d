"""An MLP classifier trained data-parallel with DistributedDataParallel under the tuned policy.

    python examples/ddp_mlp.py                                   # one process
    torchrun --nproc-per-node 2 examples/ddp_mlp.py              # two processes (gloo on a CPU, nccl on GPUs)
    mpadvise tune --nproc-per-node 2 examples/ddp_mlp.py -- --steps 60
                                                                 # every trial runs through torchrun

The order matters: ``mp.setup(model, optimizer)`` converts the bare model for the precision
mode (a "-true" mode casts it, an FP8 mode swaps its layers), and only then is the model
wrapped in DistributedDataParallel, whose gradient buckets follow the converted parameters.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import advisor


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
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    # The data and, outside a trial, the initial weights are the same on every process.
    torch.manual_seed(0)
    x = torch.randn(args.samples, 256)
    y = (torch.tanh(x @ torch.randn(256, 16)) @ torch.randn(16, 10)).argmax(dim=1)
    dataset = TensorDataset(x, y)

    mp = advisor.load_policy()  # each process applies the same policy, on its own device
    init_process_group(mp.device)
    net = nn.Sequential(
        nn.Linear(256, args.width), nn.GELU(),
        nn.Linear(args.width, args.width), nn.GELU(),
        nn.Linear(args.width, 10),
    )
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr))
    model = DistributedDataParallel(model)
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
