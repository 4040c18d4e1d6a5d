"""A small DistributedDataParallel loop in which one rank fails after a few steps.

    python ddp_rank_fails.py RANK STEP raise   # rank RANK raises at step STEP
    python ddp_rank_fails.py RANK STEP hang    # rank RANK stops answering at step STEP
    python ddp_rank_fails.py RANK STEP nan     # rank RANK's loss is NaN at step STEP
    python ddp_rank_fails.py RANK STEP sigkill # rank RANK kills itself (SIGKILL) at step STEP
    python ddp_rank_fails.py RANK STEP exit3   # rank RANK ends by os._exit(3) at step STEP
    python ddp_rank_fails.py                   # no rank fails

Every rank writes its pid to $DDP_PID_DIR/<rank> (when set), so a test can look for them after.
"""

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

import advisor

failing_rank, failing_step, how = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]) if len(sys.argv) > 3 else (-1, 0, "")
mp = advisor.load_policy()
dist.init_process_group("gloo")
rank = dist.get_rank()
if os.environ.get("DDP_PID_DIR"):
    Path(os.environ["DDP_PID_DIR"], str(rank)).write_text(str(os.getpid()))
model, opt = mp.setup(nn.Linear(8, 1), None), None
model = DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(50):
    if rank == failing_rank and step == failing_step:
        if how == "raise":
            raise ValueError(f"bad batch at step {step}")
        if how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "exit3":
            os._exit(3)
        if how == "hang":
            time.sleep(3600)
    with mp.autocast():
        loss = model(mp.to_device(torch.randn(16, 8))).float().pow(2).mean()
    if rank == failing_rank and step == failing_step and how == "nan":
        loss = loss * float("nan")
    mp.step(loss, opt)
dist.destroy_process_group()
