"""Passes: dropout and shuffled data make every step's loss noisy, but every mode trains alike.

An MLP classifier with dropout 0.3 on labels of which 10% are flipped, reshuffled every epoch.
Single-step losses jump by tens of percent; the smoothed curves of the 16-bit modes follow
fp32's. The weights are large next to Adam's updates at lr 1e-3 only by a factor of about 100,
well within bf16's 8 significant bits, so even pure bf16 trains as fp32 does.

Truth (scripts/verdict_truth.py: fp32 and each mode, 405 recorded steps, warm-up included, seed 0):
- bf16-mixed: stable. fp32 1.335 -> 0.6477, bf16-mixed 1.335 -> 0.6477; end ratio 1, fall ratio 1.
- bf16-true: stable. fp32 1.335 -> 0.6477, bf16-true 1.336 -> 0.6452; end ratio 0.996, fall ratio 1.
- fp16-mixed: stable. fp32 1.335 -> 0.6477, fp16-mixed 1.335 -> 0.6466; end ratio 0.998, fall ratio 1.
  mpadvise trial tests/verdicts/pass_dropout_noisy.py -m bf16-mixed -m bf16-true -m fp16-mixed --steps 400 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
x = torch.randn(4096, 32)
clean = (x @ torch.randn(32, 4)).argmax(dim=1)
y = torch.where(torch.rand(4096) < 0.1, torch.randint(0, 4, (4096,)), clean)

mp = advisor.load_policy()
net = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Dropout(0.3), nn.Linear(128, 128), nn.ReLU(), nn.Dropout(0.3),
                    nn.Linear(128, 4))
model, optimizer = mp.setup(net, torch.optim.Adam(net.parameters(), lr=1e-3))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=mp.micro_batch_size(32),
                                     shuffle=True)
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    for xb, yb in loader:
        xb, yb = mp.to_device(xb, yb)
        with mp.autocast():
            loss = F.cross_entropy(model(xb).float(), yb)
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
