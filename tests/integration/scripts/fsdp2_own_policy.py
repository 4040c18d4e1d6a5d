"""An FSDP2 script that shards with a MixedPrecisionPolicy of its own, or with the policy's.

    torchrun --nproc-per-node 2 fsdp2_own_policy.py own       # bf16 of its own: refused at the first step
    torchrun --nproc-per-node 2 fsdp2_own_policy.py policy    # mp.fsdp_mixed_precision(): trains
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import advisor


def main() -> None:
    which = sys.argv[1] if len(sys.argv) > 1 else "own"
    torch.manual_seed(0)
    x = torch.randn(512, 32)
    y = (x[:, :4].sum(dim=1) > 0).long()
    mp = advisor.load_policy()
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    model = mp.setup(nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 2)))
    own = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    fully_shard(model, mp_policy=own if which == "own" else mp.fsdp_mixed_precision())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batch = mp.micro_batch_size(16)
    rank, world = dist.get_rank(), dist.get_world_size()
    step = 0
    while True:
        start = ((step * world + rank) * batch) % (len(x) - batch)
        xb, yb = mp.to_device(x[start:start + batch], y[start:start + batch])
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, optimizer)
        step += 1
        if step >= 400:
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
