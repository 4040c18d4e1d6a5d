"""A small GPT-2 language model, built from its config, trained with the Hugging Face Trainer
on generated sequences; it never imports mpadvise and downloads nothing.

    python examples/hf_trainer.py                              # as written: fp32 (bf16=False, fp16=False)
    mpadvise trial examples/hf_trainer.py --mode bf16-mixed    # fp32 against bf16-mixed, side by side
    mpadvise tune examples/hf_trainer.py                       # the fastest stable precision and micro-batch
    mpadvise run examples/hf_trainer.py                        # trains under the tuned policy

Under mpadvise the policy is applied through TrainingArguments (bf16/fp16/tf32, and
per_device_train_batch_size with gradient_accumulation_steps for a micro-batch split that keeps
the global batch), whatever this script passes.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


class CountingSequences(torch.utils.data.Dataset):
    """Token sequences that count up by a per-sequence stride (mod the vocabulary): a model that
    has seen two tokens can predict the rest, so the loss falls quickly and steadily."""

    def __init__(self, samples: int, length: int, vocab: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (samples, 1), generator=g)
        stride = torch.randint(1, 8, (samples, 1), generator=g)
        self.tokens = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (max_steps)")
    parser.add_argument("--batch-size", type=int, default=32, help="per_device_train_batch_size")
    parser.add_argument("--accum", type=int, default=1, help="gradient_accumulation_steps")
    parser.add_argument("--width", type=int, default=128, help="n_embd")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--context", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--bf16", action="store_true", help="TrainingArguments(bf16=True)")
    args = parser.parse_args()

    set_seed(42)
    config = GPT2Config(vocab_size=256, n_positions=args.context, n_embd=args.width, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=args.batch_size,
            gradient_accumulation_steps=args.accum,
            learning_rate=args.lr,
            warmup_steps=20,
            bf16=args.bf16,
            fp16=False,
            use_cpu=not torch.cuda.is_available(),  # the Trainer allows bf16 on a CPU only when told so
            logging_steps=50,
            save_strategy="no",
            report_to="none",
        )
        trainer = Trainer(model=model, args=training_args,
                          train_dataset=CountingSequences(8192, args.context, config.vocab_size))
        result = trainer.train()
    print(f"final loss {result.training_loss:.4f} in {args.steps} steps "
          f"(mixed_precision={trainer.accelerator.mixed_precision})")


if __name__ == "__main__":
    main()
