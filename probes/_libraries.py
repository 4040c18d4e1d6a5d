"""Installed versions of the FP8 libraries, read from package metadata without importing them."""

from __future__ import annotations

import contextlib
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
