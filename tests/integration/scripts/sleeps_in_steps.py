"""A training loop whose steps sleep: a trial of it runs for minutes. One process, or each rank
of several (gloo). Every process writes its pid to $SLEEPER_PID_DIR/<rank>.

    python sleeps_in_steps.py
"""

import os
import time
from pathlib import Path

import torch
import torch.nn as nn

import advisor

mp = advisor.load_policy()
rank = int(os.environ.get("RANK", "0"))
model = mp.setup(nn.Linear(8, 1), None)
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
Path(os.environ["SLEEPER_PID_DIR"], str(rank)).write_text(str(os.getpid()))
for _ in range(100000):
    time.sleep(0.5)
    with mp.autocast():
        loss = model(mp.to_device(torch.randn(16, 8))).float().pow(2).mean()
    mp.step(loss, opt)
