"""Process-wide matmul switches, set for a block and restored exactly afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def matmul_switches(*, tf32: bool, cuda: bool) -> Iterator[None]:
    """Turn TF32 on or off for matmuls (and cuDNN convolutions on CUDA) inside the block.

    Restores the float32 matmul precision and both ``allow_tf32`` flags exactly, also when the
    block raises.
    """
    import torch

    saved_precision = torch.get_float32_matmul_precision()
    saved_matmul = torch.backends.cuda.matmul.allow_tf32
    saved_cudnn = torch.backends.cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision("high" if tf32 else "highest")
        if cuda:
            torch.backends.cuda.matmul.allow_tf32 = tf32
            torch.backends.cudnn.allow_tf32 = tf32
        yield
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        torch.backends.cuda.matmul.allow_tf32 = saved_matmul
        torch.backends.cudnn.allow_tf32 = saved_cudnn
