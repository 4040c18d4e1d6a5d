"""A small GPT trained by a hand-written loop in the usual style, with its own precision code.

Plain PyTorch, no mpadvise: its own ``torch.amp.autocast`` under a ``dtype`` variable, a
``GradScaler`` that is enabled for float16, gradient clipping through ``scaler.unscale_``,
evaluation and an optional checkpoint before the first step, and ``--key=value`` overrides of
the settings below. The tokens follow a fixed random Markov chain (four possible successors
each), so the loss falls from ln(vocab) towards ln(4). Runs in seconds on a CPU:

    python examples/plain_gpt.py
    python examples/plain_gpt.py --dtype=bfloat16 --max_iters=50
    mpadvise tune examples/plain_gpt.py            # no changed line: its precision is overruled
    mpadvise run examples/plain_gpt.py -- --max_iters=200
"""

import math
import os
import sys
from contextlib import nullcontext

import torch
import torch.nn as nn
import torch.nn.functional as F

# -----------------------------------------------------------------------------
# settings, overridden with --key=value
out_dir = ""  # where a checkpoint is saved at each evaluation ('' for none)
eval_interval = 100
eval_iters = 4
log_interval = 1
max_iters = 30
gradient_accumulation_steps = 1
batch_size = 16
block_size = 32
vocab_size = 128
n_layer = 2
n_head = 4
n_embd = 64
learning_rate = 3e-3
grad_clip = 1.0
seed = 1337
device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float32"
# -----------------------------------------------------------------------------
for arg in sys.argv[1:]:
    key, _, value = arg.removeprefix("--").partition("=")
    if key not in globals() or key.startswith("_"):
        raise SystemExit(f"unknown setting --{key}")
    globals()[key] = type(globals()[key])(value) if not isinstance(globals()[key], str) else value

torch.manual_seed(seed)
device_type = "cuda" if "cuda" in device else "cpu"
ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
ctx = nullcontext() if dtype == "float32" else torch.amp.autocast(device_type=device_type, dtype=ptdtype)

# a fixed random first-order Markov chain: each token has four possible successors
chain = torch.Generator().manual_seed(0)
successors = torch.randint(0, vocab_size, (vocab_size, 4), generator=chain)
data_gen = torch.Generator().manual_seed(seed)


def get_batch():
    start = torch.randint(0, vocab_size, (batch_size, 1), generator=data_gen)
    choice = torch.randint(0, 4, (batch_size, block_size), generator=data_gen)
    tokens = [start[:, 0]]
    for t in range(block_size):
        tokens.append(successors[tokens[-1], choice[:, t]])
    seq = torch.stack(tokens, dim=1)
    return seq[:, :-1].to(device), seq[:, 1:].to(device)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


model = GPT().to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=0.1)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == "float16"))
print(f"ln(vocab) {math.log(vocab_size):.3f}, ln(4) {math.log(4):.3f}; training in {dtype} on {device}")


@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = torch.zeros(eval_iters)
    for k in range(eval_iters):
        X, Y = get_batch()
        with ctx:
            _, loss = model(X, Y)
        losses[k] = loss.item()
    model.train()
    return losses.mean().item()


X, Y = get_batch()
for iter_num in range(max_iters + 1):
    if iter_num % eval_interval == 0:
        print(f"iter {iter_num}: eval loss {estimate_loss():.4f}")
        if out_dir:
            os.makedirs(out_dir, exist_ok=True)
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": iter_num},
                       os.path.join(out_dir, "ckpt.pt"))
    if iter_num == max_iters:
        break
    for _micro_step in range(gradient_accumulation_steps):
        with ctx:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        X, Y = get_batch()
        scaler.scale(loss).backward()
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if iter_num % log_interval == 0:
        print(f"iter {iter_num}: loss {loss.item() * gradient_accumulation_steps:.6f}")
