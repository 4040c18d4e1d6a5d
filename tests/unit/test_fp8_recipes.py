"""FP8 support per recipe: what each library's recipe needs of the device, the CUDA build and
the library version, decided before any trial starts (fake GPU profiles, no device)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import gpu_profile

from advisor._load import resolve_policy
from advisor.trial import TrialSpec, run_in_process
from policies import Fp8Options, Policy, supported_modes
from probes import HardwareProfile, MpadviseError

TE_21 = (("torchao", "0.18.0"), ("transformer_engine", "2.1.0"))
TE_23 = (("torchao", "0.18.0"), ("transformer_engine", "2.3.0"))
TE_29 = (("torchao", "0.18.0"), ("transformer_engine", "2.9.0+cu12"))
# torch's arch lists: the cu126 wheels stop at Hopper, the cu128 ones add Blackwell.
CU126_ARCHES = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")
CU128_ARCHES = ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")


def rtx_5090(**changes) -> HardwareProfile:
    """A 12.0 Blackwell card, built from the B200's fake profile."""
    return replace(gpu_profile("B200"), name="NVIDIA GeForce RTX 5090", compute_capability=(12, 0), **changes)


def with_recipe(mode: str, recipe: str | None) -> Policy:
    return Policy(mode=mode, fp8=Fp8Options(recipe=recipe) if recipe else None)


def recipe_support(profile: HardwareProfile, mode: str, recipe: str | None):
    return supported_modes(profile, with_recipe(mode, recipe))[mode]


# --- Transformer Engine's recipes ------------------------------------------------------------


@pytest.mark.parametrize(
    ("profile", "recipe", "supported", "words"),
    [
        (gpu_profile("B200"), "mxfp8", True, "mxfp8"),
        (gpu_profile("H100"), "mxfp8", False, "needs compute capability 10.x or 11.x"),
        (gpu_profile("L4"), "mxfp8", False, "needs compute capability 10.x or 11.x"),
        (rtx_5090(), "mxfp8", False, "this is 12.0"),
        (replace(gpu_profile("H100"), cuda_runtime="12.9"), "block", False, "transformer-engine 2.3 or newer"),
        (replace(gpu_profile("H100"), libraries=TE_23), "block", False, "CUDA 12.9 or newer"),
        (replace(gpu_profile("H100"), libraries=TE_23, cuda_runtime="12.9"), "block", True, "block"),
        (replace(gpu_profile("L4"), libraries=TE_29, cuda_runtime="12.9"), "block", False, "9.0 or newer"),
        (replace(gpu_profile("B200"), libraries=TE_23, cuda_runtime="12.9"), "block", False, "9.x"),
        (replace(gpu_profile("B200"), libraries=TE_29, cuda_runtime="12.9"), "block", True, "block"),
        (gpu_profile("H100"), "current", False, "transformer-engine 2.2 or newer (this is 2.1.0)"),
        (replace(gpu_profile("H100"), libraries=TE_23), "current", True, "current"),
        (gpu_profile("H100"), "delayed", True, "delayed"),
        (gpu_profile("H100"), None, True, "delayed"),
    ],
    ids=lambda v: v.name if isinstance(v, HardwareProfile) else str(v),
)
def test_te_recipe_support(profile, recipe, supported, words):
    support = recipe_support(profile, "fp8-te", recipe)
    assert support.supported is supported, support.reason
    assert support.reason.startswith("fp8-te: ")
    assert words in support.reason


def test_te_refuses_mxfp8_on_12x_and_says_what_to_use():
    reason = recipe_support(rtx_5090(), "fp8-te", "mxfp8").reason
    assert reason.startswith("fp8-te: recipe 'mxfp8' on NVIDIA GeForce RTX 5090 needs compute capability 10.x or 11.x")
    assert reason.endswith("set [fp8] recipe to one that runs here: delayed")


def test_the_whole_mode_is_judged_as_before():
    """supported_modes(profile) without a policy answers for the mode (its default recipe)."""
    for key in ("H100", "B200", "L4"):
        assert supported_modes(gpu_profile(key))["fp8-te"].supported
    assert supported_modes(rtx_5090())["fp8-te"].supported  # delayed scaling runs on 12.0


def test_fp8_te_reason_lists_the_recipes_this_version_has():
    reason = supported_modes(gpu_profile("H100"))["fp8-te"].reason
    assert "transformer-engine 2.1.0" in reason
    assert "recipes here: delayed" in reason
    assert "not here: current needs transformer-engine 2.2 or newer (this is 2.1.0)" in reason
    assert "mxfp8 needs compute capability 10.x or 11.x (this is 9.0)" in reason
    newer = supported_modes(replace(gpu_profile("H100"), libraries=TE_29, cuda_runtime="12.9"))["fp8-te"].reason
    assert "recipes here: delayed, current, block" in newer


def test_only_transformer_engine_offers_mxfp8():
    support = supported_modes(gpu_profile("B200"))
    assert "MXFP8" in support["fp8-te"].reason
    assert "MXFP8" not in support["fp8-torchao"].reason
    assert "recipes here: tensorwise, rowwise, rowwise_with_gw_hp" in support["fp8-torchao"].reason


# --- what the device and the torch build need, for every recipe -------------------------------


@pytest.mark.parametrize("mode", ["fp8-te", "fp8-torchao"])
def test_fp8_on_ada_needs_cuda_12_1(mode):
    old = supported_modes(replace(gpu_profile("L4"), cuda_runtime="11.8"))[mode]
    assert not old.supported
    assert "CUDA 12.1 or newer" in old.reason and "11.8" in old.reason
    assert supported_modes(replace(gpu_profile("L4"), cuda_runtime="12.1"))[mode].supported
    # Hopper has no such floor.
    assert supported_modes(replace(gpu_profile("H100"), cuda_runtime="11.8"))[mode].supported


@pytest.mark.parametrize("mode", ["fp8-te", "fp8-torchao"])
def test_a_torch_build_without_kernels_for_the_gpu_is_unsupported(mode):
    b200 = replace(gpu_profile("B200"), cuda_arch_list=CU126_ARCHES)
    support = supported_modes(b200)[mode]
    assert not support.supported
    assert "sm_100" in support.reason and "10.0" in support.reason
    assert supported_modes(replace(gpu_profile("B200"), cuda_arch_list=CU128_ARCHES))[mode].supported
    assert supported_modes(replace(gpu_profile("H100"), cuda_arch_list=CU126_ARCHES))[mode].supported
    assert not supported_modes(rtx_5090(cuda_arch_list=CU126_ARCHES))[mode].supported


def test_a_profile_without_an_arch_list_is_not_judged_on_it():
    assert gpu_profile("B200").cuda_arch_list == ()
    assert supported_modes(gpu_profile("B200"))["fp8-te"].supported


def test_recipe_support_on_a_cpu_is_the_mode_support():
    cpu = HardwareProfile(kind="cpu", name="cpu", libraries=(("torchao", "0.18.0"), ("transformer_engine", None)))
    for recipe in ("tensorwise", "rowwise", "rowwise_with_gw_hp"):
        assert recipe_support(cpu, "fp8-torchao", recipe) == supported_modes(cpu)["fp8-torchao"]
    assert not recipe_support(cpu, "fp8-te", "delayed").supported


# --- callers decide before a trial or a run starts ---------------------------------------------


def test_a_trial_of_an_unsupported_recipe_is_unsupported_before_it_starts(tmp_path):
    ran = []
    spec = TrialSpec(policy=with_recipe("fp8-te", "mxfp8").to_dict(), result_path=str(tmp_path / "r.json"))
    data, error = run_in_process(ran.append, spec, profile=gpu_profile("H100"))
    assert error is None and ran == []
    assert data["stage"] == "unsupported"
    assert "recipe 'mxfp8'" in data["reason"] and "10.x or 11.x" in data["reason"]


def test_load_policy_refuses_an_unsupported_recipe_with_the_reason():
    with pytest.raises(MpadviseError, match=r"recipe 'block'.*CUDA 12\.9 or newer"):
        resolve_policy(with_recipe("fp8-te", "block"), profile=replace(gpu_profile("H100"), libraries=TE_23), script=None)
    policy = with_recipe("fp8-te", "delayed")
    assert resolve_policy(policy, profile=gpu_profile("H100"), script=None).policy == policy
