"""matmul_benchmark on the CPU: rows, skips, validation, and every global switch restored."""

from __future__ import annotations

import json

import pytest
import torch
from fakes import gpu_profile
from test_switches import NEW_API, SWITCHES

import probes._bench as bench
from probes import BenchRow, HardwareProfile, MpadviseError, matmul_benchmark, matmul_switches
from probes._bench import default_bench_dtypes

CPU = HardwareProfile(kind="cpu", name="test CPU", cores=2)
FAST = {"size": 64, "min_seconds": 0.01, "repeats": 3}


def test_cpu_rows_for_default_dtypes():
    rows = matmul_benchmark(CPU, **FAST)
    assert [row.dtype for row in rows] == ["fp32", "fp16", "bf16"]
    for row in rows:
        assert isinstance(row, BenchRow)
        assert row.skipped is None
        # Three repeats, or two where one call outlasted min_seconds (a loaded machine can
        # stretch one); the rule itself is tested with a fake clock below.
        assert row.device == "cpu" and row.size == 64 and row.repeats in (2, 3)
        assert row.tflops > 0 and row.seconds > 0
        assert row.tflops == pytest.approx(2 * 64**3 / row.seconds / 1e12)
        assert row.ratio_vs_fp32 > 0  # no claim on which is faster: that is what it measures
        assert row.spread >= 0
        assert row.peak_tflops is None and row.fraction_of_peak is None  # no CPU datasheet
    assert rows[0].ratio_vs_fp32 == 1.0


def _fake_cpu_clock(monkeypatch, seconds_per_call):
    """Every timed matmul takes ``seconds_per_call``; the call counts of each timing, in order."""
    timings: list[int] = []

    def timer(matmul, calls):
        timings.append(calls)
        return calls * seconds_per_call

    monkeypatch.setattr(bench, "_cpu_timer", timer)
    return timings


@pytest.mark.parametrize(("per_call", "timed"), [(0.19, 2), (0.25, 2), (0.05, 4), (0.04, 5)])
def test_a_cpu_dtype_one_call_of_which_outlasts_a_repeats_share_is_timed_by_single_calls(
        monkeypatch, per_call, timed):
    # bf16 without a fast path (AVX2): a fifth of a second per call at the default size. Single
    # calls, the calibration one among them, fill the 0.2 s budget, two at least; five repeats of
    # one call would spend a second.
    timings = _fake_cpu_clock(monkeypatch, per_call)
    (row,) = matmul_benchmark(CPU, dtypes=("bf16",), size=64, min_seconds=0.2, repeats=5)
    assert timings == [1] * timed
    assert row.repeats == timed and row.seconds == pytest.approx(per_call) and row.spread == pytest.approx(0)


def test_the_figure_is_the_fastest_repeat_since_a_disturbance_only_slows_a_matmul(monkeypatch):
    # Three of five repeats ran beside a neighbour's burst, two at the hardware's rate. The
    # median would call the burst the peak that every MFU is measured against.
    per_call = iter([0.001, 0.003, 0.001, 0.0025, 0.001, 0.002])  # calibration, then the repeats
    monkeypatch.setattr(bench, "_cpu_timer", lambda matmul, calls: calls * next(per_call))
    (row,) = matmul_benchmark(CPU, dtypes=("fp32",), size=64, min_seconds=0.2, repeats=5)
    assert row.seconds == pytest.approx(0.001) and row.tflops == pytest.approx(2 * 64**3 / 0.001 / 1e12)
    assert row.spread == pytest.approx((0.003 - 0.001) / 0.002)  # the noise is still the median's


def test_a_fast_cpu_dtype_keeps_its_repeats_within_the_budget(monkeypatch):
    timings = _fake_cpu_clock(monkeypatch, 0.001)
    (row,) = matmul_benchmark(CPU, dtypes=("fp32",), size=64, min_seconds=0.2, repeats=5)
    assert timings == [1] + [40] * 5  # calibration, then 0.04 s of calls per repeat
    assert row.repeats == 5 and row.seconds == pytest.approx(0.001)


def test_a_skipped_row_has_no_repeats():
    (row,) = matmul_benchmark(CPU, dtypes=("fp8",), **FAST)
    assert row.skipped and row.repeats == 0


def test_rows_serialise_to_json():
    (row,) = matmul_benchmark(CPU, dtypes=["fp32"], **FAST)
    data = json.loads(json.dumps(row.to_dict()))
    assert data["dtype"] == "fp32" and data["tflops"] == row.tflops


def test_cuda_only_dtypes_are_skipped_on_cpu_with_a_reason():
    rows = {row.dtype: row for row in matmul_benchmark(CPU, dtypes=("fp8", "tf32"), **FAST)}
    assert list(rows) == ["tf32", "fp8"]  # canonical order
    assert rows["tf32"].tflops is None and "CPU" in rows["tf32"].skipped
    assert rows["fp8"].tflops is None and "8.9" in rows["fp8"].skipped


def test_without_fp32_there_is_no_ratio():
    (row,) = matmul_benchmark(CPU, dtypes=("bf16",), **FAST)
    assert row.tflops > 0 and row.ratio_vs_fp32 is None


def test_fraction_of_peak_when_the_datasheet_is_known(monkeypatch):
    monkeypatch.setattr(bench, "peak_tflops", lambda profile: {"fp32": 2.0})
    (row,) = matmul_benchmark(CPU, dtypes=("fp32",), **FAST)
    assert row.peak_tflops == 2.0
    assert row.fraction_of_peak == pytest.approx(row.tflops / 2.0)


def test_an_unknown_dtype_names_the_field():
    with pytest.raises(MpadviseError, match="dtypes"):
        matmul_benchmark(CPU, **{**FAST, "dtypes": ("fp64",)})


def test_cuda_profile_without_cuda_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(MpadviseError, match="torch.cuda is not available"):
        matmul_benchmark(gpu_profile("H100"), **FAST)


def _read(getter):
    try:
        return getter()
    except RuntimeError:
        return "refused"  # torch refuses to report a mixed legacy/new state


def _switches():
    matmul = torch.backends.cuda.matmul
    return (
        _read(torch.get_float32_matmul_precision),
        _read(lambda: matmul.allow_tf32),
        getattr(matmul, "fp32_precision", None),
        getattr(torch.backends.mkldnn.matmul, "fp32_precision", None),
        torch.is_grad_enabled(),
    )


@pytest.fixture
def default_precision():
    """Leave the process's matmul precision switches as a fresh process has them."""
    yield
    torch.set_float32_matmul_precision("highest")
    for backend in (torch.backends.cuda, torch.backends.mkldnn):
        if hasattr(backend.matmul, "fp32_precision"):
            backend.matmul.fp32_precision = "none"


def _set_legacy_tf32():
    torch.backends.cuda.matmul.allow_tf32 = True


def _set_new_tf32_only():
    torch.backends.cuda.matmul.fp32_precision = "tf32"


def _set_new_ieee_with_legacy_high():
    torch.set_float32_matmul_precision("high")
    torch.backends.cuda.matmul.fp32_precision = "ieee"


STARTING_STATES = {
    "default": lambda: None,
    "legacy-allow-tf32": _set_legacy_tf32,
    "high": lambda: torch.set_float32_matmul_precision("high"),
    "medium": lambda: torch.set_float32_matmul_precision("medium"),
    "highest": lambda: torch.set_float32_matmul_precision("highest"),
    "mixed-new-tf32": _set_new_tf32_only,
    "mixed-new-ieee": _set_new_ieee_with_legacy_high,
}


@pytest.mark.parametrize("state", sorted(STARTING_STATES))
@pytest.mark.parametrize("precision", ["high", "highest"])
def test_precision_switches_restored_exactly(default_precision, state, precision):
    if not hasattr(torch.backends.cuda.matmul, "fp32_precision") and state.startswith("mixed"):
        pytest.skip("this torch has only the legacy API")
    STARTING_STATES[state]()
    before = _switches()
    with pytest.raises(RuntimeError, match="boom"), matmul_switches(tf32=precision == "high", cuda=False):
        # Inside, the legacy and new switches agree, so cuBLAS will not refuse to run.
        assert torch.backends.cuda.matmul.allow_tf32 == (precision == "high")
        assert torch.get_float32_matmul_precision() == precision
        raise RuntimeError("boom")
    assert _switches() == before


def test_benchmark_restores_switches_and_rng_state(default_precision):
    torch.set_float32_matmul_precision("medium")
    rng = torch.random.get_rng_state()
    before = _switches()
    matmul_benchmark(CPU, **FAST)
    assert _switches() == before
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_default_dtypes_follow_the_hardware():
    assert default_bench_dtypes(CPU) == ("fp32", "fp16", "bf16")
    assert default_bench_dtypes(gpu_profile("V100")) == ("fp32", "fp16", "bf16")
    assert default_bench_dtypes(gpu_profile("A100")) == ("fp32", "tf32", "fp16", "bf16")
    assert default_bench_dtypes(gpu_profile("H100")) == ("fp32", "tf32", "fp16", "bf16", "fp8")


class _RampingGpu:
    """A GPU timer whose matmul takes 2 ms until its clocks have ramped (after 0.15 s of
    work), then 1 ms: what an idle GPU does in its first tenth of a second of load."""

    SLOW, FAST, RAMP_S = 2e-3, 1e-3, 0.15

    def __init__(self) -> None:
        self.busy = 0.0

    def __call__(self, matmul, calls: int) -> float:
        elapsed = 0.0
        for _ in range(calls):
            per_call = self.SLOW if self.busy < self.RAMP_S else self.FAST
            self.busy += per_call
            elapsed += per_call
        return elapsed


def test_cuda_warm_up_lasts_until_the_clocks_have_ramped(monkeypatch):
    gpu = _RampingGpu()
    monkeypatch.setattr(bench, "_cuda_timer", lambda torch: gpu)
    monkeypatch.setattr(bench, "_operands", lambda *args: lambda: None)
    seconds, spread, repeats = bench._measure(torch, gpu_profile("H100"), "bf16", 8192, 0.2, 5)
    assert seconds == pytest.approx(_RampingGpu.FAST)  # not a median of slow calls
    assert spread == pytest.approx(0.0)
    assert repeats == 5  # the slow-call rule is a CPU one: a GPU's first calls ramp its clocks
    assert gpu.busy < 0.6  # the warm-up ends soon after the ramp; then 0.2 s of repeats


def test_cuda_warm_up_stops_once_timings_settle():
    calls: list[int] = []

    def steady(matmul, n: int) -> float:
        calls.append(n)
        return n * 1e-3

    per_call = bench._cuda_warm_up(steady, lambda: None)
    assert per_call == pytest.approx(1e-3)
    assert 0.2 <= sum(calls) * 1e-3 < 0.3  # at least the minimum, and not much beyond once settled


def test_cuda_warm_up_gives_up_waiting_for_timings_that_never_settle():
    spent: list[float] = []

    def throttled(matmul, n: int) -> float:  # alternately 1 ms and 2 ms per call
        spent.append(n * (1e-3 if len(spent) % 2 else 2e-3))
        return spent[-1]

    bench._cuda_warm_up(throttled, lambda: None)
    assert bench._CUDA_WARMUP_MAX_S <= sum(spent) < bench._CUDA_WARMUP_MAX_S + 0.2


def test_fp8_row_uses_fast_accumulation(monkeypatch):
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8 dtypes")
    seen: list[dict] = []

    def scaled_mm(a, b, **kwargs):
        seen.append(kwargs)
        return a.float() @ b.float()

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    on_cpu = HardwareProfile(kind="cpu", name="test CPU")  # the operands' device only
    bench._operands(torch, on_cpu, "fp8", 16)()
    (kwargs,) = seen
    assert kwargs["use_fast_accum"] is True
    assert kwargs["out_dtype"] == torch.bfloat16


class _FakeCudaForBench:
    def __init__(self, monkeypatch) -> None:
        self.events: list[str] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device", lambda index: _Recorded(self.events, f"device {index}"))
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: self.events.append("empty_cache"))


class _Recorded:
    def __init__(self, events: list[str], name: str) -> None:
        self.events, self.name = events, name

    def __enter__(self) -> None:
        self.events.append(f"enter {self.name}")

    def __exit__(self, *exc) -> None:
        self.events.append(f"exit {self.name}")


def test_benchmark_gives_its_cached_gpu_memory_back(monkeypatch):
    cuda = _FakeCudaForBench(monkeypatch)

    def measure(torch, profile, dtype, *args):
        cuda.events.append(f"measure {dtype}")
        return 1e-3, 0.0, 3

    monkeypatch.setattr(bench, "_measure", measure)
    matmul_benchmark(gpu_profile("H100"), dtypes=("fp32", "bf16"), **FAST)
    assert cuda.events == ["enter device 0", "measure fp32", "measure bf16", "empty_cache", "exit device 0"]


def test_benchmark_gives_its_gpu_memory_back_after_an_error(monkeypatch):
    cuda = _FakeCudaForBench(monkeypatch)

    def measure(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "_measure", measure)
    with pytest.raises(KeyboardInterrupt):
        matmul_benchmark(gpu_profile("H100"), dtypes=("fp32",), **FAST)
    assert cuda.events == ["enter device 0", "empty_cache", "exit device 0"]


# ---- the fp32_precision switches (torch >= 2.9): own values, "none" included ----------------
# Every (backend, operator) switch; ("generic", "all") is the root. A switch set to "none"
# inherits from (backend, "all"), which inherits from the generic one, and torch's getters
# report the value in effect, so a switch that inherits and one set to the same value read
# alike until a parent changes. The switches are test_switches' list.
# What a user may have set before calling the benchmark: each an ordered list of writes.
USER_SETTINGS = {
    "fresh process": [],
    "generic tf32": [(("generic", "all"), "tf32")],
    "generic ieee": [(("generic", "all"), "ieee")],
    "cuda all tf32": [(("cuda", "all"), "tf32")],
    "mkldnn all tf32": [(("mkldnn", "all"), "tf32")],
    "mkldnn matmul bf16": [(("mkldnn", "matmul"), "bf16")],
    "generic tf32, cuda matmul ieee": [(("generic", "all"), "tf32"), (("cuda", "matmul"), "ieee")],
    "legacy high": "high",
    "legacy medium": "medium",
}
# What the user sets after the benchmark; each must reach the switches it reached before.
LATER_CHANGES = [
    (("generic", "all"), "ieee"),
    (("generic", "all"), "tf32"),
    (("mkldnn", "all"), "ieee"),
    (("cuda", "all"), "ieee"),
]


def _fresh_switches() -> None:
    torch.set_float32_matmul_precision("highest")
    torch.backends.cudnn.allow_tf32 = True
    if NEW_API:
        for switch in SWITCHES:
            if switch not in (("cuda", "conv"), ("cuda", "rnn")):  # a fresh process reads these "tf32"
                torch._C._set_fp32_precision_setter(*switch, "none")


@pytest.fixture
def fresh_switches():
    """Start and leave the test with the switches as a fresh process has them."""
    _fresh_switches()
    yield
    _fresh_switches()


def _apply(setting) -> None:
    if isinstance(setting, str):
        torch.set_float32_matmul_precision(setting)
        return
    for switch, value in setting:
        torch._C._set_fp32_precision_setter(*switch, value)


def _every_switch() -> dict[tuple[str, str], str]:
    return {switch: torch._C._get_fp32_precision_getter(*switch) for switch in SWITCHES}


def _after_later_changes(setting, run_between) -> list[dict[tuple[str, str], str]]:
    """The switches after the user's setting, ``run_between``, and then each later change."""
    _fresh_switches()
    _apply(setting)
    run_between()
    seen = [_every_switch()]
    for switch, value in LATER_CHANGES:
        torch._C._set_fp32_precision_setter(*switch, value)
        seen.append(_every_switch())
    return seen


@pytest.mark.skipif(not NEW_API, reason="this torch has only the legacy TF32 API")
@pytest.mark.parametrize("setting", sorted(USER_SETTINGS))
def test_benchmark_leaves_every_fp32_precision_switch_inheriting_as_before(fresh_switches, setting):
    """After the benchmark, every switch reads as before, and one that inherited ("none")
    still inherits: a generic or per-backend ``fp32_precision`` set afterwards reaches
    oneDNN's and cuBLAS's matmuls exactly as it would have without the benchmark."""
    setting = USER_SETTINGS[setting]
    untouched = _after_later_changes(setting, lambda: None)
    benchmarked = _after_later_changes(setting, lambda: matmul_benchmark(CPU, dtypes=("fp32", "bf16"), **FAST))
    assert benchmarked[0] == untouched[0], "the switches read as before"
    assert benchmarked[1:] == untouched[1:], "a later change reaches the same switches"
