"""Which modes exist and which class applies each: adding a mode means adding a file and a line."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from probes._errors import MpadviseError

from ._config import MODES

if TYPE_CHECKING:
    import torch

    from ._base import PrecisionMode
    from ._config import Policy

# Module and class per mode, imported on first use so that an unused mode's library (torchao,
# Transformer Engine) is never imported.
MODE_CLASSES: dict[str, tuple[str, str]] = {
    "fp32": ("policies.fp32", "Fp32"),
    "tf32": ("policies.tf32", "Tf32"),
    "fp16-mixed": ("policies.fp16_mixed", "Fp16Mixed"),
    "bf16-mixed": ("policies.bf16_mixed", "Bf16Mixed"),
    "fp16-true": ("policies.fp16_true", "Fp16True"),
    "bf16-true": ("policies.bf16_true", "Bf16True"),
    "fp8-te": ("policies.fp8_te", "Fp8Te"),
    "fp8-torchao": ("policies.fp8_torchao", "Fp8Torchao"),
}

if set(MODE_CLASSES) != set(MODES):  # a mode added to one list and not the other
    raise RuntimeError(f"mode registry out of sync: {sorted(set(MODE_CLASSES) ^ set(MODES))}")


def mode_class(mode: str) -> type[PrecisionMode]:
    """The class that applies ``mode``."""
    try:
        module_name, class_name = MODE_CLASSES[mode]
    except KeyError:
        raise MpadviseError(f"unknown mode {mode!r}; expected one of {', '.join(MODES)}") from None
    return getattr(importlib.import_module(module_name), class_name)


def create_mode(policy: Policy, device: torch.device) -> PrecisionMode:
    """Instantiate the mode object for ``policy`` on ``device``."""
    return mode_class(policy.mode)(policy, device)
