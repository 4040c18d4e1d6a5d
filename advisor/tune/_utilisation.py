"""How far each candidate runs from what the hardware can do: achieved TFLOP/s and MFU.

The fp32 reference counts its FLOPs per optimizer step once, and every candidate runs the same
arithmetic, so its TFLOP/s is that count over its median step time; its MFU is that over the
probed matmul peak of the dtype its matmuls run in (measured here, not a datasheet figure).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from policies import mode_facts


def compute_dtype(mode: str) -> str:
    """The dtype a mode's matmuls run in, as the matmul benchmark names it."""
    facts = mode_facts(mode)
    if facts.fp8_library is not None:
        return "fp8"
    if facts.autocast is not None:
        return facts.autocast
    if facts.weights != "fp32":
        return facts.weights
    return "tf32" if facts.tf32 else "fp32"


@dataclass(frozen=True)
class Utilisation:
    """One candidate's achieved throughput against the hardware's; ``peak_tflops`` and ``mfu`` are
    ``None`` where the dtype's peak was not probed."""

    tflops: float
    dtype: str
    peak_tflops: float | None = None
    mfu: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def utilisation(flops_per_step: float | None, median_step_s: float | None, mode: str,
                peaks: dict[str, float] | None) -> Utilisation | None:
    """A candidate's achieved TFLOP/s and MFU; ``None`` without a FLOP count or a step time. A
    dtype the benchmark did not measure has no MFU; one it measured slower than fp32 is held to
    fp32's rate (``dtype`` then says ``fp32``)."""
    if not flops_per_step or not median_step_s or flops_per_step <= 0 or median_step_s <= 0:
        return None
    tflops = flops_per_step / median_step_s / 1e12
    dtype = compute_dtype(mode)
    peaks = peaks or {}
    peak = peaks.get(dtype)
    if peak is not None and peaks.get("fp32") and peak < peaks["fp32"]:
        # No fast path for this dtype here (bf16 on a CPU without AVX512-BF16 or AMX): the
        # hardware's best rate for the work is fp32's, and the slow path is no peak to be near.
        dtype, peak = "fp32", peaks["fp32"]
    return Utilisation(round(tflops, 6), dtype, peak, round(tflops / peak, 6) if peak else None)
