"""Trains a few steps, then crashes (a bug in the user's loop), or segfaults with 'segv'."""

import os
import signal
import sys

import torch
import torch.nn as nn

import advisor

mp = advisor.load_policy()
model, opt = mp.setup(nn.Linear(8, 1), None), None
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(10):
    with mp.autocast():
        loss = model(mp.to_device(torch.randn(16, 8))).float().pow(2).mean()
    mp.step(loss, opt)
    if step == 3:
        if sys.argv[1:] == ["segv"]:
            os.kill(os.getpid(), signal.SIGSEGV)
        raise KeyError("labels")
