"""A causal transformer language model sized to keep a GPU busy, trained under the policy
mpadvise resolves.

At its defaults (width 1024, 4 layers, context 512, batch 16: 8192 tokens and about 55 million
weights in matmuls per step) the matmuls dominate a step on a GPU, so precision modes differ
in speed as they would in real training: the tokens are generated once on the training device
(no DataLoader, no host-to-device copies) and the loss is read back to the host only when it
is printed. The tokens follow a fixed random first-order Markov chain (each token has four
possible successors), so the loss falls from ln(vocab) towards ln(4) and the stability
verdicts have a real curve to judge. Small sizes run on a CPU:

    python examples/gpt_lm.py                                  # the policy load_policy() resolves
    python examples/gpt_lm.py --mode bf16-mixed                # a mode applied by hand
    python examples/gpt_lm.py --width 64 --layers 2 --context 32 --vocab 256   # small, for a CPU
    python examples/gpt_lm.py --flops                          # FLOPs per step, then exit
    mpadvise trial examples/gpt_lm.py -m bf16-mixed -m fp8-torchao

``train_flops`` counts a training step's FLOPs as the usual model-FLOPs utilisation figures do
(PaLM, appendix B): 6 per matmul weight per token (forward and backward), plus the attention
scores and their weighted sum, 12 x layers x width x context per token, counted in full as
those figures count them although a causal kernel skips about half.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

SUCCESSORS = 4  # each token's possible next tokens in the generated chain


def matmul_weights(*, width: int, layers: int, vocab: int) -> int:
    """The weights that multiply activations in a step (the embeddings are lookups)."""
    per_layer = 3 * width * width + width * width + 2 * 4 * width * width  # qkv, out, mlp up and down
    return layers * per_layer + width * vocab  # and the output head


def train_flops(*, width: int, layers: int, context: int, vocab: int, batch: int) -> float:
    """FLOPs of one training step (forward and backward) on ``batch`` sequences of ``context``
    tokens, counted as model-FLOPs utilisation is (see the module's docstring)."""
    per_token = 6 * matmul_weights(width=width, layers=layers, vocab=vocab) + 12 * layers * width * context
    return float(per_token * batch * context)


class Block(nn.Module):
    """A pre-norm transformer block: causal self-attention, then a 4x MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        b, t, w = h.shape
        q, k, v = self.qkv(self.norm1(h)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + self.out(attended.transpose(1, 2).reshape(b, t, w))
        return h + self.down(F.gelu(self.up(self.norm2(h)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(context, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():
            if name.endswith(("out.weight", "down.weight")):  # GPT-2's scaling of the residual writes
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))
            elif p.dim() == 2 and name != "position":
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def markov_tokens(sequences: int, length: int, vocab: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """``sequences`` token sequences of ``length`` from a fixed random Markov chain, made on ``device``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    successors = torch.randint(vocab, (vocab, SUCCESSORS), generator=generator, device=device)
    choices = torch.randint(SUCCESSORS, (sequences, length), generator=generator, device=device)
    tokens = torch.empty(sequences, length, dtype=torch.long, device=device)
    tokens[:, 0] = torch.randint(vocab, (sequences,), generator=generator, device=device)
    for t in range(1, length):
        tokens[:, t] = successors[tokens[:, t - 1], choices[:, t]]
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", help="apply this precision mode instead of the resolved policy")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per optimizer step")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=6e-4)
    parser.add_argument("--pool", type=int, default=256, help="sequences generated once, drawn from each step")
    parser.add_argument("--flops", action="store_true", help="print the FLOPs of one step as JSON and exit")
    args = parser.parse_args()
    sizes = {"width": args.width, "layers": args.layers, "context": args.context, "vocab": args.vocab}
    if args.flops:
        print(json.dumps({**sizes, "batch": args.batch_size, "matmul_weights": matmul_weights(
            width=args.width, layers=args.layers, vocab=args.vocab),
            "train_flops_per_step": train_flops(**sizes, batch=args.batch_size)}))
        return

    torch.manual_seed(0)
    mp = advisor.load_policy(advisor.Policy(mode=args.mode) if args.mode else None)
    net = GPT(vocab=args.vocab, width=args.width, layers=args.layers, heads=args.heads, context=args.context)
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=0.0))
    micro_batch = mp.micro_batch_size(args.batch_size)
    pool = markov_tokens(max(args.pool, micro_batch), args.context + 1, args.vocab, mp.device)
    order = torch.Generator(device=mp.device).manual_seed(1)
    with mp:
        for step in range(args.steps):
            rows = torch.randint(pool.shape[0], (micro_batch,), generator=order, device=mp.device)
            batch = pool[rows]
            tokens, targets = mp.to_device(batch[:, :-1], batch[:, 1:])
            with mp.autocast():
                logits = model(tokens)
                loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), targets.reshape(-1))
            mp.step(loss, optimizer)
            if (step + 1) % 50 == 0:
                print(f"step {step + 1} loss {loss.item():.4f}")  # the only read-back to the host


if __name__ == "__main__":
    main()
