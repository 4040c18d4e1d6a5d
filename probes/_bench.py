"""Achieved square-matmul TFLOP/s per dtype on one device: where this hardware's roofline is.
A prior for the search and a figure against the datasheet peak, never a verdict: a model's step
time also depends on memory traffic, launch overhead and layer sizes."""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from probes._capability import peak_tflops
from probes._errors import MpadviseError
from probes._profile import HardwareProfile
from probes._switches import matmul_switches

BENCH_DTYPES: tuple[str, ...] = ("fp32", "tf32", "fp16", "bf16", "fp8")

# Big enough to saturate a data-centre GPU's tensor cores; on a CPU without native bf16 a
# 1024 matmul takes seconds per call, so 512 keeps the whole CPU run near two seconds.
_DEFAULT_SIZE = {"cuda": 8192, "cpu": 512}
# CUDA warm-up goes by time, not calls (cuBLAS picks its algorithm on the first call, and an idle
# GPU's clocks take a few tenths of a second of load to boost): at least the minimum, then until
# two timings agree within SETTLED, never beyond the maximum (a throttled GPU may never settle).
_CUDA_WARMUP_MIN_S = 0.2
_CUDA_WARMUP_MAX_S = 2.0
_CUDA_WARMUP_SETTLED = 0.03
# Each warm-up timing covers about this much work, so that launch jitter does not decide it.
_CUDA_WARMUP_BATCH_S = 0.05


@dataclass(frozen=True)
class BenchRow:
    """One dtype's measured matmul throughput on one device. ``tflops`` and ``seconds`` are the
    fastest repeat's (a neighbour's burst or a GPU's clocks only ever slow a matmul); ``spread``,
    ``(slowest - fastest) / median``, is the noise, so close dtypes are not ranked on it."""

    dtype: str
    device: str
    size: int
    tflops: float | None = None
    seconds: float | None = None
    ratio_vs_fp32: float | None = None
    peak_tflops: float | None = None
    fraction_of_peak: float | None = None
    repeats: int = 0
    skipped: str | None = None
    spread: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def default_bench_dtypes(profile: HardwareProfile) -> tuple[str, ...]:
    """The dtypes worth measuring here: bf16 on every GPU too (pre-Ampere, it shows what
    emulation costs); TF32 and FP8 only where a GPU has them."""
    if not profile.is_cuda:
        return ("fp32", "fp16", "bf16")
    cc = profile.compute_capability or (0, 0)
    floors = {"tf32": (8, 0), "fp8": (8, 9)}
    return tuple(dtype for dtype in BENCH_DTYPES if cc >= floors.get(dtype, (0, 0)))


def matmul_benchmark(profile: HardwareProfile, *, dtypes: tuple[str, ...] | list[str] | None = None,
                     size: int | None = None, min_seconds: float = 0.2, repeats: int = 5) -> list[BenchRow]:
    """One ``BenchRow`` per dtype, in ``BENCH_DTYPES`` order (skipped where the device cannot
    run it); ``min_seconds`` per dtype, split over the ``repeats``. Every switch touched (TF32,
    the current CUDA device) is restored, also after an error, the operands' CUDA memory given
    back, and the global RNG left alone.

    Raises:
        MpadviseError: a dtype is unknown, or the profile is a CUDA device torch cannot see.
    """
    if dtypes is None:
        dtypes = default_bench_dtypes(profile)
    unknown = [d for d in dtypes if d not in BENCH_DTYPES]
    if unknown:
        raise MpadviseError(f"dtypes: unknown {', '.join(map(repr, unknown))}; "
                            f"expected some of {', '.join(BENCH_DTYPES)}")
    size = size or _DEFAULT_SIZE[profile.kind]

    import torch

    if profile.is_cuda and not torch.cuda.is_available():
        raise MpadviseError(f"cannot benchmark {profile.device} ({profile.name}): torch.cuda is "
                            "not available in this process; check the driver and "
                            "CUDA_VISIBLE_DEVICES")
    measured: dict[str, tuple[float, float, int] | str] = {}
    with contextlib.ExitStack() as stack:
        if profile.is_cuda:
            stack.enter_context(torch.cuda.device(profile.index or 0))
            # Last out, also after an error: the caching allocator would keep the operands'
            # memory (gigabytes at size 8192) reserved in this process, and a tune runs its
            # trials on the same GPU after the benchmark.
            stack.callback(torch.cuda.empty_cache)
        stack.enter_context(torch.no_grad())
        for dtype in (d for d in BENCH_DTYPES if d in dtypes):
            reason = _skip_reason(torch, profile, dtype)
            measured[dtype] = reason or _measure(torch, profile, dtype, size, min_seconds, repeats)

    peaks = peak_tflops(profile)
    fp32 = measured.get("fp32")
    fp32_tflops = _tflops(size, fp32[0]) if isinstance(fp32, tuple) else None
    rows = []
    for dtype, result in measured.items():
        row = BenchRow(dtype, profile.device, size, peak_tflops=peaks.get(dtype))
        if isinstance(result, str):
            rows.append(replace(row, skipped=result))
            continue
        seconds, spread, repeats_run = result
        tflops = _tflops(size, seconds)
        rows.append(replace(row, tflops=tflops, seconds=seconds, repeats=repeats_run, spread=spread,
                            ratio_vs_fp32=tflops / fp32_tflops if fp32_tflops else None,
                            fraction_of_peak=tflops / row.peak_tflops if row.peak_tflops else None))
    return rows


def _tflops(size: int, seconds: float) -> float:
    return 2.0 * size**3 / seconds / 1e12


def _skip_reason(torch: Any, profile: HardwareProfile, dtype: str) -> str | None:
    cc = profile.compute_capability
    if dtype == "tf32":
        if not profile.is_cuda:
            return "tf32 is a CUDA tensor-core format; this is a CPU"
        if cc is not None and cc < (8, 0):
            return f"tf32 needs compute capability >= 8.0; this is {cc[0]}.{cc[1]}"
    if dtype == "fp8":
        if not profile.is_cuda:
            return "fp8 matmul needs CUDA (compute capability >= 8.9); this is a CPU"
        if cc is not None and cc < (8, 9):
            return f"fp8 matmul needs compute capability >= 8.9; this is {cc[0]}.{cc[1]}"
        if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
            return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


def _operands(torch: Any, profile: HardwareProfile, dtype: str, size: int) -> Callable[[], Any]:
    device = profile.device
    generator = torch.Generator(device=device).manual_seed(0)

    def randn() -> Any:
        return torch.randn(size, size, generator=generator, device=device, dtype=torch.float32)

    if dtype == "fp8":
        a = randn().to(torch.float8_e4m3fn)
        # _scaled_mm wants the second operand column-major: a row-major (N, K) transposed.
        b = randn().to(torch.float8_e4m3fn).t()
        scale = torch.ones((), device=device, dtype=torch.float32)
        # Fast accumulation, as FP8 training runs its forward GEMM (torchao's default recipe);
        # without it cuBLAS promotes the partial sums along the way and the row would measure
        # a slower kernel than the one training uses.
        return lambda: torch._scaled_mm(
            a, b, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16, use_fast_accum=True
        )
    torch_dtype = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    a, b = randn().to(torch_dtype), randn().to(torch_dtype)
    return lambda: torch.mm(a, b)


def _measure(torch: Any, profile: HardwareProfile, dtype: str, size: int, min_seconds: float,
             repeats: int) -> tuple[float, float, int] | str:
    """``(seconds per matmul of the fastest repeat, spread, repeats)``, or why it was skipped."""
    try:
        # TF32 only for the tf32 row; the fp32 row must be IEEE even if the caller enabled TF32
        # (or, on a CPU, bf16 via "medium"). Only matmuls run here, so cuDNN's switches stay.
        with matmul_switches(tf32=dtype == "tf32", cuda=False):
            matmul = _operands(torch, profile, dtype, size)
            timer = _cuda_timer(torch) if profile.is_cuda else _cpu_timer
            # On a CPU the warm-up call doubles as the calibration: an emulated dtype takes a
            # fifth of a second per call.
            one_call = _cuda_warm_up(timer, matmul) if profile.is_cuda else timer(matmul, 1)
            per_repeat = min_seconds / repeats
            if not profile.is_cuda and one_call >= per_repeat:
                # One call outlasts a repeat's share (bf16 emulated by AVX2 at a hundredth of
                # fp32's rate): single calls fill the budget, two at least, not seconds past it.
                count = max(2, min(repeats, math.ceil(min_seconds / max(one_call, 1e-9))))
                samples = [one_call] + [timer(matmul, 1) for _ in range(count - 1)]
            else:
                calls = max(1, math.ceil(per_repeat / max(one_call, 1e-9)))
                samples = [timer(matmul, calls) / calls for _ in range(repeats)]
    except Exception as error:
        # An OOM on a small GPU or a kernel this build lacks skips one dtype, not the run.
        if type(error).__name__ == "OutOfMemoryError":
            return f"out of memory at size {size}; pass a smaller size"
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"{dtype} matmul failed: {first_line[:200]}"
    median = statistics.median(samples)
    spread = (max(samples) - min(samples)) / median if median > 0 else 0.0
    return min(samples), spread, len(samples)


def _cuda_warm_up(timer: Callable[[Callable[[], Any], int], float], matmul: Callable[[], Any]) -> float:
    """Run the matmul until the GPU's clocks have ramped up; returns the last seconds per call."""
    spent, calls, previous = 0.0, 1, None
    while True:
        elapsed = timer(matmul, calls)
        spent += elapsed
        per_call = elapsed / calls
        settled = previous is not None and abs(per_call - previous) <= _CUDA_WARMUP_SETTLED * previous
        if spent >= _CUDA_WARMUP_MAX_S or (spent >= _CUDA_WARMUP_MIN_S and settled):
            return per_call
        previous = per_call
        calls = max(1, math.ceil(_CUDA_WARMUP_BATCH_S / max(per_call, 1e-9)))


def _cpu_timer(matmul: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        matmul()
    return time.perf_counter() - start


def _cuda_timer(torch: Any) -> Callable[[Callable[[], Any], int], float]:
    def timer(matmul: Callable[[], Any], calls: int) -> float:
        # Events time the GPU work itself; a host clock would include launch latency.
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(calls):
            matmul()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    return timer
