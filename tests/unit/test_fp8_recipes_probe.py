"""The torch build's CUDA architectures in a profile: gathered by the probe, judged by FP8 support,
kept out of the hardware fingerprint, and absent from profiles stored before it existed."""

from __future__ import annotations

from dataclasses import replace

from fakes import GPUS, FakeNvml, FakeTorchCuda

from policies import supported_modes
from probes import HardwareProfile, cuda_profiles, hardware_fingerprint

CU126 = ("sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_86", "sm_90")


class BuiltFor(FakeTorchCuda):
    """``torch.cuda`` of a build compiled for ``arch_list``."""

    def __init__(self, gpus, arch_list) -> None:
        super().__init__(gpus)
        self.arch_list = arch_list

    def get_arch_list(self) -> list[str]:
        if isinstance(self.arch_list, Exception):
            raise self.arch_list
        return list(self.arch_list)


def _probe(torch_cuda, key: str = "B200") -> HardwareProfile:
    (profile,) = cuda_profiles(
        torch_cuda=torch_cuda, nvml=FakeNvml([GPUS[key]]), cuda_runtime="12.6", torch_version="2.7.0+cu126"
    )
    return replace(profile, libraries=(("torchao", "0.18.0"), ("transformer_engine", "2.9.0")))


def test_the_probe_records_the_arch_list_and_fp8_support_reads_it():
    profile = _probe(BuiltFor([GPUS["B200"]], CU126))
    assert profile.cuda_arch_list == CU126
    support = supported_modes(profile)
    assert not support["fp8-torchao"].supported
    assert "torch 2.7.0+cu126 was built for sm_50" in support["fp8-torchao"].reason
    assert "lists sm_100" in support["fp8-torchao"].reason
    hopper = _probe(BuiltFor([GPUS["H100"]], CU126), key="H100")
    assert supported_modes(hopper)["fp8-torchao"].supported


def test_a_build_that_cannot_say_records_nothing():
    assert _probe(FakeTorchCuda([GPUS["B200"]])).cuda_arch_list == ()  # no get_arch_list
    assert _probe(BuiltFor([GPUS["B200"]], RuntimeError("no CUDA"))).cuda_arch_list == ()


def test_the_arch_list_round_trips_and_stays_out_of_the_fingerprint():
    profile = _probe(BuiltFor([GPUS["B200"]], CU126))
    again = HardwareProfile.from_dict(profile.to_dict())
    assert again == profile and hash(again) == hash(profile)
    assert profile.to_dict()["cuda_arch_list"] == list(CU126)
    assert hardware_fingerprint(profile) == hardware_fingerprint(replace(profile, cuda_arch_list=()))


def test_a_profile_stored_before_the_field_loads():
    stored = _probe(BuiltFor([GPUS["B200"]], CU126)).to_dict()
    del stored["cuda_arch_list"]
    assert HardwareProfile.from_dict(stored).cuda_arch_list == ()
