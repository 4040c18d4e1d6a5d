"""A plain DDP loop under torchrun (gloo on a CPU): init_process_group, DDP(model), no_sync-style
accumulation through require_backward_grad_sync, and no mpadvise."""

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 4)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
accum = int(os.environ.get("ACCUM", "2"))
gen = torch.Generator().manual_seed(rank)
for step in range(200):
    for micro in range(accum):
        model.require_backward_grad_sync = micro == accum - 1
        x = torch.randn(16, 32, generator=gen)
        loss = F.cross_entropy(model(x), (x[:, :4]).argmax(dim=1)) / accum
        loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"step {step} loss {loss.item() * accum:.6f}")
dist.destroy_process_group()
