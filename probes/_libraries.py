"""Installed versions of torch and the FP8 libraries, read from package metadata without
importing them; and whether a GPU driver is here at all, read from its device files."""

from __future__ import annotations

import contextlib
import glob
import os
from importlib import metadata

# Library name as recorded in a profile -> distribution names that provide it, first found
# wins. Transformer Engine has shipped as "transformer-engine" (the meta package, which
# pulls in the framework extension), as "transformer_engine" (older wheels and source
# builds), and its PyTorch extension alone as "transformer-engine-torch".
FP8_LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torchao", ("torchao",)),
    ("transformer_engine",
     ("transformer-engine", "transformer_engine", "transformer-engine-torch")),
)


def fp8_library_versions() -> tuple[tuple[str, str | None], ...]:
    """``(("torchao", "0.18.0"), ("transformer_engine", None))``, sorted, from package metadata
    only: importing torchao takes seconds and prints warnings, transformer_engine starts CUDA."""
    return tuple(sorted((library, first_installed(names)) for library, names in FP8_LIBRARIES))


def first_installed(distributions: tuple[str, ...]) -> str | None:
    for distribution in distributions:
        # A half-removed install can leave unreadable metadata: absent, not a failed probe.
        with contextlib.suppress(metadata.PackageNotFoundError, OSError, ValueError):
            return metadata.version(distribution)
    return None


def torch_release() -> str | None:
    """torch's version as its package records it (the same string as ``torch.__version__``),
    without the seconds ``import torch`` takes; ``torch.__version__`` only where torch runs from
    a tree with no package metadata; ``None`` without torch."""
    if (recorded := first_installed(("torch",))) is not None:
        return recorded
    with contextlib.suppress(ImportError):
        import torch

        return str(torch.__version__)
    return None


# What a GPU driver leaves on a host (or in a container given a GPU), as globs under the root:
# NVIDIA's control and device files and /proc entry, WSL2's GPU paravirtualisation device,
# ROCm's compute device (torch.cuda serves HIP). Without any of them torch cannot see a CUDA
# device, and nothing needs to import it to say so.
_DRIVER_FILES = ("dev/nvidiactl", "dev/nvidia[0-9]*", "proc/driver/nvidia", "dev/dxg", "dev/kfd")


def gpu_driver_present(root: str = "/") -> bool:
    """Whether a GPU driver's files are here; ``False`` means torch would find no CUDA device."""
    return any(glob.glob(os.path.join(root, pattern)) for pattern in _DRIVER_FILES)
