"""The host CPU as a HardwareProfile: model, precision-relevant ISA flags, cores, memory."""

from __future__ import annotations

import os
import platform
from pathlib import Path

from probes._libraries import fp8_library_versions
from probes._profile import HardwareProfile

# The x86 flags that decide whether low precision is fast on a CPU: AVX2 is the baseline
# oneDNN needs; AVX512-BF16 and AMX-BF16 (with AMX-TILE) make bf16 matmuls native; AVX512-FP16
# and AMX-FP16 do the same for fp16. Without them PyTorch converts to fp32 internally and
# low precision is slower than fp32.
PRECISION_FLAGS: frozenset[str] = frozenset(
    {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16"}
)


def parse_cpuinfo(text: str) -> tuple[str, tuple[str, ...]]:
    """``(model name, sorted PRECISION_FLAGS present)`` from ``/proc/cpuinfo``'s first block
    (every logical CPU reports the same); the name is ``""`` where there is none (ARM)."""
    model = ""
    flags: set[str] = set()
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                continue
            key = key.strip().lower()
            if key == "model name" and not model:
                model = value.strip()
            elif key == "flags" and not flags:
                flags = set(value.split()) & PRECISION_FLAGS
        break
    return model, tuple(sorted(flags))


def cpu_profile(cpuinfo_path: str | os.PathLike[str] = "/proc/cpuinfo", *,
                meminfo_path: str | os.PathLike[str] = "/proc/meminfo") -> HardwareProfile:
    """Probe the host CPU. Without ``/proc`` (macOS) the flags are empty, which the support
    table reads as "no native bf16/fp16", the safe answer."""
    try:
        text = Path(cpuinfo_path).read_text(encoding="utf-8", errors="replace")
    except OSError:
        text = ""
    model, flags = parse_cpuinfo(text)
    if not model:
        model = platform.processor() or platform.machine() or "unknown CPU"
    memory_total, memory_free = _memory(meminfo_path)
    return HardwareProfile(kind="cpu", name=model, memory_total=memory_total, memory_free=memory_free,
                           cores=_usable_cores(), cpu_flags=flags, torch_version=_torch_version(),
                           libraries=fp8_library_versions())


def _usable_cores() -> int | None:
    # The affinity mask, not os.cpu_count(): under taskset, a cgroup cpuset or a batch
    # scheduler this process may use fewer cores than the machine has.
    if hasattr(os, "sched_getaffinity"):
        try:
            return len(os.sched_getaffinity(0))
        except OSError:
            pass
    return os.cpu_count()


def _memory(meminfo_path: str | os.PathLike[str]) -> tuple[int | None, int | None]:
    total: int | None = None
    available: int | None = None
    try:
        for line in Path(meminfo_path).read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if not parts or not parts[0].isdigit():
                continue
            # meminfo reports kibibytes whatever the unit column says.
            if key == "MemTotal":
                total = int(parts[0]) * 1024
            elif key == "MemAvailable":
                available = int(parts[0]) * 1024
    except OSError:
        pass
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, OSError, ValueError):
            total = None
    return total, available


def _torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)
