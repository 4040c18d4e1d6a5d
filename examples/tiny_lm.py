"""A small character-level transformer language model on generated text, trained under the
policy mpadvise resolves.

The text comes from a small seeded grammar, so the example needs no download and the model has
real structure to learn (agreement, word order, punctuation).

    python examples/tiny_lm.py
    mpadvise tune examples/tiny_lm.py
"""

from __future__ import annotations

import argparse
import random

import torch
import torch.nn as nn
import torch.nn.functional as F

import advisor

SUBJECTS = ["the engineer", "a student", "the model", "my cat", "the old sailor", "a robot", "the teacher"]
VERBS = ["reads", "writes", "measures", "tunes", "watches", "builds", "paints", "trains"]
OBJECTS = ["a book", "the logs", "every tensor", "the sea", "a small boat", "the loss curve", "two gradients"]
ADVERBS = ["slowly", "carefully", "at night", "with care", "again", "in silence", "before dawn"]


def generate_text(sentences: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        if rng.random() < 0.5:
            s += f" {rng.choice(ADVERBS)}"
        if rng.random() < 0.3:
            s += f" and {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
        out.append(s[0].upper() + s[1:] + rng.choice([".", ".", "!", "?"]))
    return " ".join(out)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int = 64, layers: int = 2, heads: int = 4, context: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(context, width))
        block = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.embed(tokens) + self.position[:t]
        h = self.blocks(h, mask=self.mask[:t, :t].to(h.dtype), is_causal=True)
        return self.head(self.norm(h))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", help="apply this precision mode instead of the resolved policy")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()

    torch.manual_seed(0)
    text = generate_text(4000)
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    starts = torch.arange(0, len(data) - args.context - 1, args.context // 2)
    inputs = torch.stack([data[s : s + args.context] for s in starts])
    targets = torch.stack([data[s + 1 : s + 1 + args.context] for s in starts])
    dataset = torch.utils.data.TensorDataset(inputs, targets)

    mp = advisor.load_policy(advisor.Policy(mode=args.mode) if args.mode else None)
    net = TinyLM(len(chars), width=args.width, context=args.context)
    model, optimizer = mp.setup(net, torch.optim.AdamW(net.parameters(), lr=args.lr))
    loader = torch.utils.data.DataLoader(dataset, batch_size=mp.micro_batch_size(args.batch_size), shuffle=True)
    step = 0
    with mp:
        while step < args.steps:
            for xb, yb in loader:
                xb, yb = mp.to_device(xb, yb)
                with mp.autocast():
                    logits = model(xb).float()
                    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), yb.reshape(-1))
                mp.step(loss, optimizer)
                step += 1
                if step % 50 == 0:
                    print(f"step {step} loss {loss.item():.4f}")
                if step >= args.steps:
                    break


if __name__ == "__main__":
    main()
