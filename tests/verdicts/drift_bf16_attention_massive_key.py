"""bf16 attention drifts: keys that carry a massive activation lose their content in bf16.

A tiny attention layer retrieves, for a query, a soft mix of the values of the tokens whose
content matches it. Every token also carries one feature with a huge constant value (1000), as
the "massive activations" of large language models' residual streams do. The keys see it: each
key is a large constant part (hundreds) plus the content (about 1). Softmax ignores a part that
is the same for every key, so fp32 learns the retrieval as if the feature were absent. bf16
keeps 8 significant bits: a key component near 300 is rounded to a multiple of 2, which wipes
out the content, and the attention logits (thousands, rounded to multiples of 8 or more) lose
the differences between keys. bf16-mixed and pure bf16 cannot learn the retrieval, and their
loss stays many times fp32's.

Truth (scripts/verdict_truth.py: fp32 and each mode, 605 recorded steps, warm-up included, seed 0):
- bf16-mixed: unstable. fp32 0.9868 -> 0.003046, bf16-mixed 1.18 -> 0.1701; end ratio 55.8, fall ratio 1.03.
- bf16-true: unstable. fp32 0.9868 -> 0.003046, bf16-true 1.092 -> 0.1353; end ratio 44.4, fall ratio 0.973.
  mpadvise trial tests/verdicts/drift_bf16_attention_massive_key.py -m bf16-mixed -m bf16-true --steps 600 --warmup 5 --json
"""

import sys

import torch
import torch.nn as nn

import advisor

torch.manual_seed(0)
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
n, length, dim = 4096, 8, 8
content = torch.randn(n, length, dim)
query = torch.randn(n, dim)
u = torch.randn(dim) / dim**0.5
weights = torch.softmax(3 * torch.einsum("nd,nld->nl", query, content) / dim**0.5, dim=1)
y = (weights * (content @ u)).sum(dim=1, keepdim=True) + 0.05 * torch.randn(n, 1)
tokens = torch.cat([content, torch.full((n, length, 1), 1000.0)], dim=2)  # the massive feature


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(dim, 16, bias=False)
        self.k = nn.Linear(dim + 1, 16, bias=False)  # keys see every feature
        self.v = nn.Linear(dim, 16, bias=False)  # values see the content only
        self.out = nn.Linear(16, 1)

    def forward(self, query: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.q(query).unsqueeze(1) @ self.k(tokens).transpose(1, 2)  # (batch, 1, length)
        mixed = torch.softmax(logits, dim=-1) @ self.v(tokens[..., :dim])
        return self.out(mixed.squeeze(1))


mp = advisor.load_policy()
net = Attention()
model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=5e-3))
batch = mp.micro_batch_size(64)
while mp.optimizer_steps < steps:  # optimizer steps, whatever the micro-batch split
    perm = torch.randperm(n)
    for i in range(0, n - batch + 1, batch):
        idx = perm[i : i + batch]
        qb, tb, yb = mp.to_device(query[idx], tokens[idx], y[idx])
        with mp.autocast():
            loss = ((model(qb, tb).float() - yb.float()) ** 2).mean()
        mp.step(loss, optimizer)
        if mp.optimizer_steps >= steps:
            break
