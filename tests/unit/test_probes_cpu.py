"""CPU probing: recorded /proc/cpuinfo samples, this machine's own, and machines without /proc."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from probes import (
    HardwareProfile,
    cpu_profile,
    fp8_library_versions,
    gpu_driver_present,
    parse_cpuinfo,
    torch_release,
)
from probes._cpu import PRECISION_FLAGS

SAMPLES = Path(__file__).parent / "data" / "cpuinfo"

EXPECTED = {
    "sapphire_rapids_8480.txt": (
        "Intel(R) Xeon(R) Platinum 8480+",
        ("amx_bf16", "amx_tile", "avx2", "avx512_bf16", "avx512_fp16", "avx512f"),
    ),
    "granite_rapids_6980p.txt": (
        "Intel(R) Xeon(R) 6980P",
        ("amx_bf16", "amx_fp16", "amx_tile", "avx2", "avx512_bf16", "avx512_fp16", "avx512f"),
    ),
    "cooper_lake_8380h.txt": (
        "Intel(R) Xeon(R) Platinum 8380H CPU @ 2.90GHz",
        ("avx2", "avx512_bf16", "avx512f"),
    ),
    "ice_lake_8375c.txt": (
        "Intel(R) Xeon(R) Platinum 8375C CPU @ 2.90GHz",
        ("avx2", "avx512f"),
    ),
    "zen4_epyc_9654.txt": (
        "AMD EPYC 9654 96-Core Processor",
        ("avx2", "avx512_bf16", "avx512f"),
    ),
    "zen1_epyc_build_machine.txt": ("AMD EPYC", ("avx2",)),
    # ARM kernels print "Features", not "flags", and no model name.
    "graviton3_arm64.txt": ("", ()),
}


def test_every_sample_has_an_expectation():
    assert sorted(p.name for p in SAMPLES.glob("*.txt")) == sorted(EXPECTED)


@pytest.mark.parametrize("sample", sorted(EXPECTED))
def test_parse_recorded_samples(sample):
    assert parse_cpuinfo((SAMPLES / sample).read_text()) == EXPECTED[sample]


def test_parse_reads_only_the_first_processor_block():
    text = "processor : 0\nmodel name : First\nflags : avx2\n\nprocessor : 1\nmodel name : Second\nflags : avx2 amx_bf16\n"
    assert parse_cpuinfo(text) == ("First", ("avx2",))


def test_parse_empty_text():
    assert parse_cpuinfo("") == ("", ())


def test_this_machines_cpuinfo_matches_grep():
    path = Path("/proc/cpuinfo")
    if not path.exists():
        pytest.skip("no /proc/cpuinfo on this system")
    text = path.read_text()
    # What `grep -m1 ^flags /proc/cpuinfo` shows, intersected with the interesting set.
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    expected = sorted(set(match.group(1).split()) & PRECISION_FLAGS) if match else []
    model, flags = parse_cpuinfo(text)
    assert list(flags) == expected
    name = re.search(r"^model name\s*:(.*)$", text, re.MULTILINE)
    assert model == (name.group(1).strip() if name else "")


def test_cpu_profile_of_this_machine():
    import torch

    profile = cpu_profile()
    assert profile.kind == "cpu" and profile.device == "cpu"
    assert profile.name
    if hasattr(os, "sched_getaffinity"):
        assert profile.cores == len(os.sched_getaffinity(0))
    assert profile.memory_total and profile.memory_total > 0
    assert profile.torch_version == torch.__version__
    assert profile.libraries == fp8_library_versions()
    assert profile.compute_capability is None and profile.driver_version is None
    assert HardwareProfile.from_dict(profile.to_dict()) == profile


def test_cpu_profile_from_a_sample_and_meminfo(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(
        "MemTotal:       263842176 kB\nMemFree:  1000 kB\nMemAvailable:   250000000 kB\n"
    )
    profile = cpu_profile(SAMPLES / "sapphire_rapids_8480.txt", meminfo_path=meminfo)
    assert profile.name == "Intel(R) Xeon(R) Platinum 8480+"
    assert profile.has_flag("amx_bf16") and profile.has_flag("avx512_fp16")
    assert profile.memory_total == 263842176 * 1024
    assert profile.memory_free == 250000000 * 1024


def test_cpu_profile_without_proc(tmp_path, monkeypatch):
    # macOS: neither /proc/cpuinfo nor /proc/meminfo.
    monkeypatch.setattr("platform.processor", lambda: "arm")
    profile = cpu_profile(tmp_path / "cpuinfo", meminfo_path=tmp_path / "meminfo")
    assert profile.name == "arm"
    assert profile.cpu_flags == ()
    assert profile.memory_free is None
    if hasattr(os, "sysconf"):
        assert profile.memory_total and profile.memory_total > 0


def test_cpu_profile_without_any_processor_name(tmp_path, monkeypatch):
    monkeypatch.setattr("platform.processor", lambda: "")
    monkeypatch.setattr("platform.machine", lambda: "aarch64")
    profile = cpu_profile(SAMPLES / "graviton3_arm64.txt", meminfo_path=tmp_path / "none")
    assert profile.name == "aarch64"


@pytest.mark.parametrize(("files", "present"), [
    ((), False),
    (("dev/null",), False),
    (("dev/nvidiactl",), True),
    (("dev/nvidia0",), True),
    (("proc/driver/nvidia/version",), True),
    (("dev/dxg",), True),  # WSL2
    (("dev/kfd",), True),  # ROCm: torch.cuda serves HIP
])
def test_a_gpu_driver_is_known_by_its_files(tmp_path, files, present):
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    assert gpu_driver_present(str(tmp_path)) is present


def test_without_a_gpu_driver_the_probes_answer_without_importing_torch():
    # A fresh interpreter, since this one has torch already; the driver check is made to say
    # "none" so that the test means the same on a GPU host.
    code = (
        "import sys, probes, probes._nvml\n"
        "probes._nvml.gpu_driver_present = lambda root='/': False\n"
        "profiles = probes.detect(); primary = probes.primary_profile(); named = probes.profile_for(None)\n"
        "assert [p.kind for p in profiles] == ['cpu'] and primary.kind == named.kind == 'cpu', profiles\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(primary.torch_version)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == torch_release() == cpu_profile().torch_version
