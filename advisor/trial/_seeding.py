"""The same start for every trial, and the fp32 replicate's one perturbation of its parameters."""

from __future__ import annotations

import contextlib
import random
from typing import Any

# The relative size of the fp32 replicate's one perturbation, by the format it stands for: a bf16
# rounding errs by at most 2^-8 of the value. How far the replicate drifts is how much this workload
# amplifies a perturbation of precision's size (docs/stability.md, "Calibration to the workload").
PERTURBATIONS: dict[str, float] = {"bf16": 2.0**-8}


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    with contextlib.suppress(ImportError):  # numpy is optional for torch
        import numpy as np

        np.random.seed(seed)


_DRAW_STRIDE = 1_000_003


def perturbation_seed(seed: int, draw: int) -> int:
    """The seed of a replicate's perturbation: the trial's for draw 0, another for each later."""
    if isinstance(draw, bool) or not isinstance(draw, int) or draw < 0:
        raise ValueError(f"perturb draw: {draw!r} is not allowed; expected a whole number >= 0")
    return (seed + _DRAW_STRIDE * draw) % 2**63


def perturb_parameters(model: Any, *, perturb: str, seed: int, draw: int = 0) -> int:
    """Multiply every floating-point parameter once by ``1 + u * e``, ``u`` uniform in [-1, 1] and
    ``e`` from ``PERTURBATIONS``; how many values were perturbed. A private generator leaves
    torch's global random state untouched, and every rank perturbs its replica alike."""
    import torch

    size = PERTURBATIONS.get(perturb)
    if size is None:
        raise ValueError(f"perturb: {perturb!r} is not a known perturbation; expected one of {sorted(PERTURBATIONS)}")
    generator = torch.Generator(device="cpu").manual_seed(perturbation_seed(seed, draw))
    count = 0
    with torch.no_grad():
        for parameter in model.parameters():
            if not parameter.is_floating_point() or parameter.numel() == 0:
                continue
            u = torch.rand(parameter.shape, generator=generator, dtype=torch.float64) * 2.0 - 1.0
            factor = (1.0 + size * u).to(device=parameter.device, dtype=torch.float32)
            parameter.mul_(factor.to(parameter.dtype))
            count += parameter.numel()
    return count
