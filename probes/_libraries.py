"""Installed versions of the FP8 libraries, read from package metadata without importing them."""

from __future__ import annotations

from importlib import metadata

__all__ = ["FP8_LIBRARIES", "fp8_library_versions"]

# Library name as recorded in a profile -> distribution names that provide it, first found
# wins. Transformer Engine has shipped as "transformer-engine" (the meta package, which
# pulls in the framework extension), as "transformer_engine" (older wheels and source
# builds), and its PyTorch extension alone as "transformer-engine-torch".
FP8_LIBRARIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("torchao", ("torchao",)),
    (
        "transformer_engine",
        ("transformer-engine", "transformer_engine", "transformer-engine-torch"),
    ),
)


def fp8_library_versions() -> tuple[tuple[str, str | None], ...]:
    """``(("torchao", "0.18.0"), ("transformer_engine", None))``: version or ``None`` each.

    Reads ``importlib.metadata`` only: importing torchao takes seconds and prints warnings
    about optional CUDA kernels, and importing transformer_engine initialises CUDA.
    The result is sorted by library name, as ``HardwareProfile.from_dict`` sorts it, so a
    profile round-trips unchanged.
    """
    versions = []
    for library, distributions in FP8_LIBRARIES:
        versions.append((library, first_installed(distributions)))
    return tuple(sorted(versions))


def first_installed(distributions: tuple[str, ...]) -> str | None:
    """The version of the first of ``distributions`` that is installed, or ``None``."""
    for distribution in distributions:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
        except (OSError, ValueError):
            # A half-removed install can leave unreadable metadata; treat it as absent
            # rather than failing the whole probe.
            continue
    return None
