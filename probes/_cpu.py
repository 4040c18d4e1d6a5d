"""The host CPU as a HardwareProfile: model, precision-relevant ISA flags, cores, memory."""

from __future__ import annotations

import contextlib
import os
import platform
from pathlib import Path

from probes._libraries import fp8_library_versions, torch_release
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
    first: dict[str, str] = {}
    for line in text.strip().split("\n\n")[0].splitlines():
        key, sep, value = line.partition(":")
        if sep:
            first.setdefault(key.strip().lower(), value.strip())
    flags = set(first.get("flags", "").split()) & PRECISION_FLAGS
    return first.get("model name", ""), tuple(sorted(flags))


def cpu_profile(cpuinfo_path: str | os.PathLike[str] = "/proc/cpuinfo", *,
                meminfo_path: str | os.PathLike[str] = "/proc/meminfo") -> HardwareProfile:
    """Probe the host CPU; without ``/proc`` (macOS), no flags: "no native bf16/fp16"."""
    text = ""
    with contextlib.suppress(OSError):
        text = Path(cpuinfo_path).read_text(encoding="utf-8", errors="replace")
    model, flags = parse_cpuinfo(text)
    memory_total, memory_free = _memory(meminfo_path)
    name = model or platform.processor() or platform.machine() or "unknown CPU"
    return HardwareProfile(kind="cpu", name=name, memory_total=memory_total,
                           memory_free=memory_free, cores=_usable_cores(), cpu_flags=flags,
                           torch_version=torch_release(), libraries=fp8_library_versions())


def _usable_cores() -> int | None:
    # The affinity mask, not os.cpu_count(): under taskset, a cgroup cpuset or a batch
    # scheduler this process may use fewer cores than the machine has.
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count()


def _memory(meminfo_path: str | os.PathLike[str]) -> tuple[int | None, int | None]:
    values: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for line in Path(meminfo_path).read_text(encoding="utf-8").splitlines():
            key, _, value = line.partition(":")
            parts = value.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024  # kibibytes whatever the unit column says
    total = values.get("MemTotal")
    if total is None:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return total, values.get("MemAvailable")
