"""Capability table by compute capability, and datasheet peaks by SKU."""

from __future__ import annotations

import pytest
from fakes import GPUS, gpu_profile

from probes import HardwareProfile, MpadviseError, capability_for, peak_tflops
from probes._capability import (
    FP8_RECIPE_RULES,
    SKU_PEAKS,
    fp8_recipe_rule,
    fp8_recipe_since,
    fp8_recipe_unmet,
    match_sku,
    release,
    torch_build_covers,
)

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


# --- what software needs of the device ----------------------------------------------------------


def test_fp8_on_ada_has_a_cuda_floor_and_other_architectures_none():
    assert capability_for((8, 9)).fp8_min_cuda == (12, 1)
    for cc in ((8, 0), (9, 0), (10, 0), (12, 0)):
        assert capability_for(cc).fp8_min_cuda is None


CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
CU129 = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")


@pytest.mark.parametrize(
    ("cc", "arch_list", "covers"),
    [
        ((9, 0), CU126, True),
        ((8, 9), CU126, True),  # sm_86 code runs on 8.9
        ((10, 0), CU126, False),
        ((12, 0), CU126, False),
        ((10, 0), CU129, True),
        ((10, 3), CU129, True),
        ((12, 1), CU129, True),
        ((8, 7), CU129, False),  # Orin runs only code built for 8.7
        ((8, 7), ("sm_87",), True),
        ((11, 0), ("sm_101",), True),  # Thor, numbered 10.1 before CUDA 13
        ((9, 0), ("sm_90a", "compute_90"), True),
        ((8, 0), ("sm_90",), False),  # no code for an older minor
        ((9, 0), (), None),  # not recorded: no answer
    ],
)
def test_torch_build_covers(cc, arch_list, covers):
    assert torch_build_covers(cc, arch_list) is covers


@pytest.mark.parametrize(
    ("recipe", "version", "dims", "tokens"),
    [("delayed", "2.1.0", 16, 8), ("mxfp8", "2.5.0", 32, 32), ("block", "2.3.0", 16, 8)],
)
def test_te_recipe_rules_carry_their_shapes(recipe, version, dims, tokens):
    rule = fp8_recipe_rule("transformer_engine", recipe, version)
    assert (rule.dim_multiple, rule.token_multiple) == (dims, tokens)


def test_torchao_recipes_and_the_weight_gradient_token_rule():
    assert {r.recipe for r in FP8_RECIPE_RULES if r.library == "torchao"} == {
        "tensorwise", "rowwise", "rowwise_with_gw_hp"
    }
    assert fp8_recipe_rule("torchao", "tensorwise").token_multiple == 16
    assert fp8_recipe_rule("torchao", "rowwise_with_gw_hp").token_multiple == 1


def test_block_scaling_rule_follows_the_te_version():
    old = fp8_recipe_rule("transformer_engine", "block", "2.8.1")
    new = fp8_recipe_rule("transformer_engine", "block", "2.9.0.dev0+abc")
    assert (old.runs_on((10, 0)), new.runs_on((10, 0))) == (False, True)
    assert fp8_recipe_since("transformer_engine", "block") == (2, 3)
    assert fp8_recipe_since("transformer_engine", "delayed") is None


@pytest.mark.parametrize(
    ("recipe", "cc", "cuda", "version", "unmet"),
    [
        ("mxfp8", (10, 0), "12.8", "2.5.0", None),
        ("mxfp8", (11, 0), "13.0", "2.9.0", None),
        ("mxfp8", (12, 0), "12.8", "2.9.0", "needs compute capability 10.x or 11.x (this is 12.0)"),
        ("mxfp8", (9, 0), "12.8", "2.9.0", "needs compute capability 10.x or 11.x (this is 9.0)"),
        ("block", (9, 0), "12.8", "2.3.0", "needs CUDA 12.9 or newer (torch was built with CUDA 12.8)"),
        ("block", (9, 0), "12.9", "2.2.1", "needs transformer_engine 2.3 or newer (this is 2.2.1)"),
        ("current", (8, 9), "12.4", "2.2.0", None),
        ("current", (8, 9), "12.4", "2.1.0", "needs transformer_engine 2.2 or newer (this is 2.1.0)"),
        ("current", (8, 9), None, None, None),  # unknown versions are not held against it
    ],
)
def test_fp8_recipe_unmet(recipe, cc, cuda, version, unmet):
    got = fp8_recipe_unmet(
        "transformer_engine", recipe, compute_capability=cc, cuda_runtime=cuda, library_version=version
    )
    assert got == unmet


def test_an_unknown_recipe_rule_is_an_error_that_lists_the_known():
    with pytest.raises(MpadviseError, match="no FP8 recipe rule for torchao recipe 'mxfp8'; known:"):
        fp8_recipe_rule("torchao", "mxfp8")


@pytest.mark.parametrize(("text", "pair"), [("2.3.0+cu12", (2, 3)), ("12.9", (12, 9)), ("dev", None), (None, None)])
def test_release(text, pair):
    assert release(text) == pair
