"""Capability table by compute capability, and datasheet peaks by SKU."""

from __future__ import annotations

import pytest
from fakes import GPUS, gpu_profile

from probes import HardwareProfile, MpadviseError, capability_for, peak_tflops
from probes._capability import SKU_PEAKS, match_sku

# cc -> (arch, fp16 tensor cores, tf32, bf16, fp8, mxfp8, nvfp4)
ARCHES = {
    (5, 2): ("pre-Volta", False, False, False, False, False, False),
    (6, 0): ("pre-Volta", False, False, False, False, False, False),
    (6, 1): ("pre-Volta", False, False, False, False, False, False),
    (7, 0): ("Volta", True, False, False, False, False, False),
    (7, 2): ("Volta", True, False, False, False, False, False),
    (7, 5): ("Turing", True, False, False, False, False, False),
    (8, 0): ("Ampere", True, True, True, False, False, False),
    (8, 6): ("Ampere", True, True, True, False, False, False),
    (8, 7): ("Ampere", True, True, True, False, False, False),
    (8, 9): ("Ada", True, True, True, True, False, False),
    (9, 0): ("Hopper", True, True, True, True, False, False),
    (10, 0): ("Blackwell", True, True, True, True, True, True),
    (10, 3): ("Blackwell", True, True, True, True, True, True),
    (12, 0): ("Blackwell", True, True, True, True, True, True),
    (12, 1): ("Blackwell", True, True, True, True, True, True),
}


@pytest.mark.parametrize("cc", sorted(ARCHES))
def test_capability_for_each_compute_capability(cc):
    cap = capability_for(cc)
    expected = ARCHES[cc]
    assert (
        cap.arch,
        cap.fp16_tensor_cores,
        cap.tf32,
        cap.bf16,
        cap.fp8,
        cap.mxfp8,
        cap.nvfp4,
    ) == expected
    assert cap.compute_capability == cc
    assert cap.label == f"{expected[0]} ({cc[0]}.{cc[1]})"


def test_capability_for_accepts_a_list_and_newer_majors_keep_blackwell_formats():
    assert capability_for([9, 0]).arch == "Hopper"
    future = capability_for((13, 0))
    assert future.arch == "post-Blackwell"
    assert future.bf16 and future.fp8 and future.mxfp8 and future.nvfp4


@pytest.mark.parametrize("bad", [(7,), (7, 0, 1), "8.0", (8.0, 0), (-1, 0), (True, 0), None])
def test_capability_for_rejects_malformed_compute_capability(bad):
    with pytest.raises(MpadviseError, match="compute_capability"):
        capability_for(bad)


@pytest.mark.parametrize(
    "name, sku",
    [
        ("Tesla P100-PCIE-16GB", "P100 PCIe"),
        ("Tesla P100-SXM2-16GB", "P100 SXM2"),
        ("Tesla V100-SXM2-16GB", "V100 SXM2"),
        ("Tesla V100-SXM2-32GB", "V100 SXM2"),
        ("Tesla V100-PCIE-32GB", "V100 PCIe"),
        ("Tesla V100S-PCIE-32GB", "V100S PCIe"),
        ("Tesla T4", "T4"),
        ("NVIDIA A100-SXM4-40GB", "A100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA A10", "A10"),
        ("NVIDIA A10G", None),
        ("NVIDIA GeForce RTX 3090", "RTX 3090"),
        ("NVIDIA GeForce RTX 3090 Ti", None),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", None),
        ("NVIDIA L4", "L4"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA L40", None),
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA B200", "B200"),
        ("NVIDIA GB200", "GB200"),
        ("NVIDIA GeForce GTX 1080 Ti", None),
    ],
)
def test_match_sku_by_device_name(name, sku):
    match = match_sku(name)
    assert (match.sku if match else None) == sku


# Figures checked against the cited datasheets (dense, no sparsity).
EXPECTED_PEAKS = {
    "P100": {"fp32": 9.3, "fp16": 18.7},
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "T4": {"fp32": 8.1, "fp16": 65.0},
    "A100": {"fp32": 19.5, "tf32": 156.0, "fp16": 312.0, "bf16": 312.0},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "fp16": 165.2, "bf16": 165.2, "fp8": 330.3},
    "L4": {"fp32": 30.3, "tf32": 60.0, "fp16": 121.0, "bf16": 121.0, "fp8": 242.5},
    "H100": {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9},
    "H200": {"fp32": 66.9, "tf32": 494.7, "fp16": 989.4, "bf16": 989.4, "fp8": 1978.9},
    "B200": {
        "fp32": 75.0,
        "tf32": 1100.0,
        "fp16": 2250.0,
        "bf16": 2250.0,
        "fp8": 4500.0,
        "fp4": 9000.0,
    },
}


@pytest.mark.parametrize("key", sorted(GPUS))
def test_peak_tflops_for_every_fake_gpu(key):
    assert peak_tflops(gpu_profile(key)) == EXPECTED_PEAKS[key]


def test_peak_tflops_unknown_sku_and_cpu_are_empty():
    assert peak_tflops(HardwareProfile(kind="cuda", name="NVIDIA H100 NVL")) == {}
    assert peak_tflops(HardwareProfile(kind="cpu", name="NVIDIA H100 80GB HBM3")) == {}


def test_peak_tflops_returns_a_fresh_dict():
    profile = gpu_profile("H100")
    peak_tflops(profile)["bf16"] = 0.0
    assert peak_tflops(profile)["bf16"] == 989.4


@pytest.mark.parametrize("peak", SKU_PEAKS, ids=lambda p: p.sku)
def test_sku_table_is_consistent(peak):
    tflops = dict(peak.tflops)
    assert set(tflops) <= {"fp32", "tf32", "fp16", "bf16", "fp8", "fp4"}
    assert all(v > 0 for v in tflops.values())
    assert len(tflops) == len(peak.tflops), "a dtype listed twice"
    assert peak.source.startswith("NVIDIA")
    # Each lower precision is at least as fast as the wider one it replaces.
    for wide, narrow in (("fp32", "fp16"), ("fp32", "tf32"), ("fp16", "fp8"), ("fp8", "fp4")):
        if wide in tflops and narrow in tflops:
            assert tflops[narrow] >= tflops[wide], (wide, narrow)
    # bf16 and fp16 tensor-core rates are equal on every card that has both.
    if "bf16" in tflops:
        assert tflops["bf16"] == tflops["fp16"]
