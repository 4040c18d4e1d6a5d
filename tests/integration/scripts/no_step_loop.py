"""Calls load_policy() and setup(), then loops forever without step(): a forgotten mp.step."""

import torch
import torch.nn as nn

import advisor

mp = advisor.load_policy()
model = mp.setup(nn.Linear(4, 4))
while True:
    with mp.autocast():
        model(mp.to_device(torch.randn(2, 4))).sum().backward()
