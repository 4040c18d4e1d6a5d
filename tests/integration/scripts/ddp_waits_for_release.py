"""A small DistributedDataParallel loop whose ranks wait, at step 2, until a file exists.

    DDP_RELEASE=/path/file DDP_PID_DIR=/path/dir python ddp_waits_for_release.py

Every rank writes its pid to $DDP_PID_DIR/<rank> once its process group is up, so a test can
look at the running trial (its sockets, its files) before it lets the ranks go on.
"""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import advisor

mp = advisor.load_policy()
dist.init_process_group("gloo")
rank = dist.get_rank()
Path(os.environ["DDP_PID_DIR"], str(rank)).write_text(str(os.getpid()))
model = DistributedDataParallel(mp.setup(nn.Linear(8, 1), None))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
release = Path(os.environ["DDP_RELEASE"])
for step in range(50):
    while step == 2 and not release.exists():
        time.sleep(0.1)
    with mp.autocast():
        loss = model(mp.to_device(torch.randn(16, 8))).float().pow(2).mean()
    mp.step(loss, opt)
dist.destroy_process_group()
