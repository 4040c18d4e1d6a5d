"""Mode support, safe defaults and summaries for every fake GPU and recorded CPU."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fakes import GPUS, WITHOUT_FP8_LIBRARIES, FakeTorchCuda, gpu_profile

from policies import (
    MODES,
    ModeSupport,
    capability_summary,
    safe_default_mode,
    supported_modes,
)
from probes import HardwareProfile, MpadviseError, cpu_profile

SAMPLES = Path(__file__).parent / "data" / "cpuinfo"

T, F = True, False
# GPU -> supported per mode (MODES order), with both FP8 libraries installed.
GPU_SUPPORT = {
    "P100": (T, F, T, F, T, F, F, F),
    "V100": (T, F, T, F, T, F, F, F),
    "T4": (T, F, T, F, T, F, F, F),
    "A100": (T, T, T, T, T, T, F, F),
    "RTX 4090": (T, T, T, T, T, T, T, T),
    "L4": (T, T, T, T, T, T, T, T),
    "H100": (T, T, T, T, T, T, T, T),
    "H200": (T, T, T, T, T, T, T, T),
    "B200": (T, T, T, T, T, T, T, T),
}
GPU_DEFAULT = {
    "P100": "fp32",
    "V100": "fp16-mixed",
    "T4": "fp16-mixed",
    "A100": "bf16-mixed",
    "RTX 4090": "bf16-mixed",
    "L4": "bf16-mixed",
    "H100": "bf16-mixed",
    "H200": "bf16-mixed",
    "B200": "bf16-mixed",
}


def _cpu(sample: str, **changes) -> HardwareProfile:
    return replace(cpu_profile(SAMPLES / sample), **changes)


@pytest.mark.parametrize("key", sorted(GPUS))
def test_gpu_support_table(key):
    support = supported_modes(gpu_profile(key))
    assert tuple(support) == MODES
    assert tuple(s.supported for s in support.values()) == GPU_SUPPORT[key]
    for mode, s in support.items():
        assert isinstance(s, ModeSupport) and s.mode == mode
        assert s.reason.startswith(f"{mode}: ")


@pytest.mark.parametrize("key", sorted(GPUS))
def test_gpu_safe_default(key):
    mode, why = safe_default_mode(gpu_profile(key))
    assert mode == GPU_DEFAULT[key]
    assert GPUS[key].name in why
    assert supported_modes(gpu_profile(key))[mode].supported


@pytest.mark.parametrize("key", ["V100", "T4"])
def test_bf16_on_volta_and_turing_is_emulated_not_supported(key):
    gpu = GPUS[key]
    assert FakeTorchCuda([gpu]).is_bf16_supported()  # what torch would claim
    support = supported_modes(gpu_profile(key))
    cc = "{}.{}".format(*gpu.compute_capability)
    for mode in ("bf16-mixed", "bf16-true"):
        assert not support[mode].supported and support[mode].emulated
        assert f"bf16 is emulated on compute capability {cc} ({gpu.name})" in support[mode].reason
        assert "is_bf16_supported() says yes" in support[mode].reason


def test_volta_default_cites_loss_scaling_evidence():
    _, why = safe_default_mode(gpu_profile("V100"))
    assert "dynamic loss scaling" in why and "Micikevicius" in why


def test_fp8_reasons_on_a100():
    support = supported_modes(gpu_profile("A100"))
    assert (
        support["fp8-te"].reason == "fp8-te: compute capability 8.0 < 8.9 (NVIDIA A100-SXM4-80GB)"
    )
    assert support["fp8-torchao"].reason == (
        "fp8-torchao: compute capability 8.0 < 8.9 (NVIDIA A100-SXM4-80GB)"
    )
    assert support["tf32"].supported


@pytest.mark.parametrize("key", ["RTX 4090", "L4", "H100", "H200", "B200"])
def test_fp8_needs_the_library_installed(key):
    support = supported_modes(gpu_profile(key, libraries=WITHOUT_FP8_LIBRARIES))
    assert not support["fp8-te"].supported
    assert support["fp8-te"].reason == (
        'fp8-te: transformer-engine is not installed (pip install "mpadvise[fp8]")'
    )
    assert not support["fp8-torchao"].supported
    assert "torchao is not installed" in support["fp8-torchao"].reason


def test_fp8_on_blackwell_mentions_block_scaling():
    support = supported_modes(gpu_profile("B200"))
    assert "MXFP8" in support["fp8-te"].reason
    assert "MXFP8" not in supported_modes(gpu_profile("H100"))["fp8-te"].reason


def test_tf32_reason_before_ampere():
    reason = supported_modes(gpu_profile("V100"))["tf32"].reason
    assert reason.startswith("tf32: needs compute capability >= 8.0")
    assert "7.0 (Tesla V100-SXM2-16GB)" in reason


def test_pre_volta_fp16_runs_without_tensor_cores():
    support = supported_modes(gpu_profile("P100"))
    assert support["fp16-mixed"].supported and "no tensor cores" in support["fp16-mixed"].reason


# CPU sample -> (bf16 emulated, fp16 emulated, default)
CPU_CASES = {
    "sapphire_rapids_8480.txt": (F, F, "bf16-mixed"),
    "granite_rapids_6980p.txt": (F, F, "bf16-mixed"),
    "cooper_lake_8380h.txt": (F, T, "fp32"),
    "zen4_epyc_9654.txt": (F, T, "fp32"),
    "ice_lake_8375c.txt": (T, T, "fp32"),
    "zen1_epyc_build_machine.txt": (T, T, "fp32"),
    "graviton3_arm64.txt": (T, T, "fp32"),
}


@pytest.mark.parametrize("sample", sorted(CPU_CASES))
def test_cpu_support_and_default(sample):
    bf16_emulated, fp16_emulated, default = CPU_CASES[sample]
    profile = _cpu(sample, libraries=(("torchao", "0.10.0"), ("transformer_engine", None)))
    support = supported_modes(profile)
    assert tuple(support) == MODES
    assert tuple(s.supported for s in support.values()) == (T, F, T, T, T, T, F, T)
    assert support["bf16-mixed"].emulated == support["bf16-true"].emulated == bf16_emulated
    assert support["fp16-mixed"].emulated == support["fp16-true"].emulated == fp16_emulated
    assert support["fp8-te"].reason == "fp8-te: needs CUDA; this is a CPU"
    assert support["fp8-torchao"] == ModeSupport(
        "fp8-torchao", True, "fp8-torchao: emulated on CPU (correct numerics, no speedup)", True
    )
    assert support["tf32"].reason.startswith("tf32: needs an NVIDIA GPU")
    assert safe_default_mode(profile)[0] == default


def test_cpu_bf16_reason_says_whether_it_is_fast():
    slow = supported_modes(_cpu("zen1_epyc_build_machine.txt"))["bf16-mixed"].reason
    assert "no AMX-BF16/AVX512-BF16: bf16 runs but is usually slower than fp32 here" in slow
    fast = supported_modes(_cpu("sapphire_rapids_8480.txt"))["bf16-mixed"].reason
    assert "AMX-BF16" in fast and "faster than fp32" in fast


def test_cpu_without_torchao_has_no_fp8():
    support = supported_modes(_cpu("ice_lake_8375c.txt", libraries=WITHOUT_FP8_LIBRARIES))
    assert not support["fp8-torchao"].supported
    assert 'pip install "mpadvise[torchao]"' in support["fp8-torchao"].reason


def test_never_defaults_to_fp8_or_a_pure_mode():
    profiles = [gpu_profile(key) for key in GPUS] + [_cpu(s) for s in CPU_CASES]
    for profile in profiles:
        mode, why = safe_default_mode(profile)
        assert not mode.startswith("fp8") and not mode.endswith("-true")
        assert why


def test_capability_summaries():
    assert (
        capability_summary(gpu_profile("H100")) == "Hopper (9.0): fp16/bf16 tensor cores, TF32, FP8"
    )
    assert capability_summary(gpu_profile("B200")) == (
        "Blackwell (10.0): fp16/bf16 tensor cores, TF32, FP8, MXFP8, NVFP4"
    )
    assert capability_summary(gpu_profile("A100")) == "Ampere (8.0): fp16/bf16 tensor cores, TF32"
    assert (
        capability_summary(gpu_profile("V100")) == "Volta (7.0): fp16 tensor cores (bf16 emulated)"
    )
    assert capability_summary(gpu_profile("P100")).startswith("pre-Volta (6.0): no tensor cores")
    summary = capability_summary(_cpu("sapphire_rapids_8480.txt", cores=56))
    assert summary.startswith("CPU (Intel(R) Xeon(R) Platinum 8480+, 56 cores): AVX2, AVX512F")
    assert "AMX-BF16" in summary


def test_cuda_profile_without_compute_capability_is_an_error():
    broken = HardwareProfile(kind="cuda", name="NVIDIA H100 80GB HBM3")
    with pytest.raises(MpadviseError, match="compute_capability"):
        supported_modes(broken)
    with pytest.raises(MpadviseError, match="compute_capability"):
        safe_default_mode(broken)


def test_support_is_a_pure_function_of_the_profile():
    profile = gpu_profile("L4")
    assert supported_modes(profile) == supported_modes(HardwareProfile.from_dict(profile.to_dict()))
