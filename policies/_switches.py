"""Process-wide matmul switches, set for a block and restored exactly afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def matmul_switches(*, tf32: bool, cuda: bool) -> Iterator[None]:
    """Turn TF32 on or off for matmuls (and cuDNN convolutions on CUDA) inside the block.

    Restores the float32 matmul precision and both ``allow_tf32`` flags exactly, also when the
    block raises. When they already hold the wanted values (inside ``with mp:``, or on every
    step of a loop) nothing is set or restored: this runs twice per training step.
    """
    import torch

    precision = "high" if tf32 else "highest"
    saved_precision = torch.get_float32_matmul_precision()
    matmul, cudnn = torch.backends.cuda.matmul, torch.backends.cudnn
    if saved_precision == precision and (not cuda or (matmul.allow_tf32 == tf32 and cudnn.allow_tf32 == tf32)):
        yield
        return
    saved_matmul = matmul.allow_tf32
    saved_cudnn = cudnn.allow_tf32
    try:
        torch.set_float32_matmul_precision(precision)
        if cuda:
            matmul.allow_tf32 = tf32
            cudnn.allow_tf32 = tf32
        yield
    finally:
        torch.set_float32_matmul_precision(saved_precision)
        matmul.allow_tf32 = saved_matmul
        cudnn.allow_tf32 = saved_cudnn
