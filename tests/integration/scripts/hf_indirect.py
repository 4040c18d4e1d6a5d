"""The wide-MLP Trainer script reached through another module: its imports name no trainer,
so the framework is not detected and ``--framework transformers`` has to say it."""

from hf_wide_mlp import main

if __name__ == "__main__":
    main()
