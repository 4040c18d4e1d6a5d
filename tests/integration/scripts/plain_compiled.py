"""A plain torch loop that compiles its model (torch.compile) after building its optimizer: the
plain adapter's hooks and casts must hold through the compiled forward."""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
model = torch.compile(model)
x = torch.randn(512, 32)
y = (x @ torch.randn(32, 4)).argmax(1)
for step in range(60):
    for i in range(0, 512, 64):
        loss = F.cross_entropy(model(x[i:i + 64]), y[i:i + 64])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    print(f"step {step} loss {loss.item():.4f}")
