"""cuda_profiles and gpu_busy through fake torch.cuda and fake NVML; never raising without CUDA."""

from __future__ import annotations

import ast
import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from fakes import CUDA_RUNTIME, GPUS, TORCH_VERSION, FakeNvml, FakeTorchCuda

import probes
from probes import cuda_profiles, fp8_library_versions, gpu_busy

PROBES_DIR = Path(probes.__file__).parent


def _profiles(torch_cuda, nvml):
    return cuda_profiles(
        torch_cuda=torch_cuda, nvml=nvml, cuda_runtime=CUDA_RUNTIME, torch_version=TORCH_VERSION
    )


@pytest.mark.parametrize("key", sorted(GPUS))
def test_every_fact_of_each_fake_gpu(key):
    gpu = GPUS[key]
    nvml = FakeNvml([gpu])
    (profile,) = _profiles(FakeTorchCuda([gpu]), nvml)
    assert profile.kind == "cuda"
    assert profile.name == gpu.name
    assert profile.index == 0
    assert profile.device == "cuda:0"
    assert profile.compute_capability == gpu.compute_capability
    assert profile.sm_count == gpu.sm_count
    assert profile.memory_total == gpu.memory_total
    assert profile.memory_free == gpu.free
    assert profile.driver_version == "550.54.15"
    assert profile.cuda_runtime == CUDA_RUNTIME
    assert profile.torch_version == TORCH_VERSION
    assert profile.mig_enabled == (None if gpu.mig_mode is None else bool(gpu.mig_mode))
    assert profile.clocks_mhz == (gpu.sm_clock, gpu.sm_clock_max)
    assert profile.uuid == gpu.uuid
    assert profile.libraries == fp8_library_versions()
    assert nvml.inits == nvml.shutdowns == 1


def test_profiles_round_trip_through_dict():
    (profile,) = _profiles(FakeTorchCuda([GPUS["H100"]]), FakeNvml([GPUS["H100"]]))
    assert type(profile).from_dict(profile.to_dict()) == profile


def test_several_devices_keep_torch_order():
    gpus = [GPUS["A100"], GPUS["A100"], GPUS["T4"]]
    gpus[1] = replace(gpus[0], uuid="GPU-aaaaaaaa-0000-0000-0000-000000000001")
    profiles = _profiles(FakeTorchCuda(gpus), FakeNvml(gpus))
    assert [p.index for p in profiles] == [0, 1, 2]
    assert [p.name for p in profiles] == [g.name for g in gpus]
    assert [p.uuid for p in profiles] == [g.uuid for g in gpus]


def test_devices_are_paired_by_uuid_when_cuda_visible_devices_hides_some(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    machine = [GPUS["A100"], GPUS["V100"], GPUS["H100"]]
    busy_h100 = replace(GPUS["H100"], memory_free=1234 * 1024**2)
    machine[2] = busy_h100
    (profile,) = _profiles(FakeTorchCuda([busy_h100]), FakeNvml(machine))
    assert profile.index == 0
    assert profile.name == "NVIDIA H100 80GB HBM3"
    assert profile.memory_free == 1234 * 1024**2  # NVML device 2, not device 0
    assert profile.uuid == busy_h100.uuid


def test_without_uuid_pairs_by_index_only_when_nothing_remaps(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpus = [GPUS["L4"], GPUS["T4"]]
    profiles = _profiles(FakeTorchCuda(gpus, with_uuid=False), FakeNvml(gpus))
    assert [p.clocks_mhz for p in profiles] == [(210, 2040), (210, 1590)]

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    (profile,) = _profiles(FakeTorchCuda([GPUS["T4"]], with_uuid=False), FakeNvml(gpus))
    assert profile.name == "Tesla T4"
    assert profile.driver_version == "550.54.15"  # system-wide, still known
    assert profile.memory_free is None and profile.clocks_mhz is None and profile.uuid is None


def test_a_mig_instance_is_not_paired_with_some_other_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    parent = GPUS["A100"]
    instance = replace(parent, uuid="MIG-5c0e7c1a-4d2b-5f3e-8a9b-0c1d2e3f4a5b", mig_mode=1)
    (profile,) = _profiles(FakeTorchCuda([instance]), FakeNvml([replace(parent, mig_mode=1)]))
    assert profile.uuid == instance.uuid  # torch's own UUID, NVML knows only the parent
    assert profile.memory_free is None and profile.clocks_mhz is None
    assert profile.driver_version == "550.54.15"


def test_nvml_init_failure_gives_profiles_without_nvml_facts():
    gpu = GPUS["A100"]
    nvml = FakeNvml([gpu], init_error=True)
    (profile,) = _profiles(FakeTorchCuda([gpu]), nvml)
    assert profile.name == gpu.name and profile.compute_capability == (8, 0)
    assert profile.memory_total == gpu.memory_total
    assert profile.driver_version is None
    assert profile.memory_free is None and profile.mig_enabled is None
    assert profile.clocks_mhz is None
    assert profile.uuid == gpu.uuid  # from torch's device properties
    assert nvml.shutdowns == 0


def test_one_failing_nvml_query_leaves_the_other_facts():
    gpu = GPUS["H100"]
    nvml = FakeNvml([gpu], failing=frozenset({"nvmlDeviceGetMaxClockInfo", "nvmlDeviceGetMigMode"}))
    (profile,) = _profiles(FakeTorchCuda([gpu]), nvml)
    assert profile.clocks_mhz is None and profile.mig_enabled is None
    assert profile.memory_free == gpu.free and profile.driver_version == "550.54.15"
    assert nvml.inits == nvml.shutdowns == 1


def test_missing_pynvml_module_is_not_an_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    (profile,) = _profiles(FakeTorchCuda([GPUS["V100"]]), None)
    assert profile.name == "Tesla V100-SXM2-16GB"
    assert profile.driver_version is None


@pytest.mark.parametrize(
    "torch_cuda",
    [
        FakeTorchCuda([GPUS["A100"]], available=False),
        FakeTorchCuda([]),
        FakeTorchCuda([GPUS["A100"]], broken=True),
    ],
    ids=["not-available", "no-devices", "driver-broken"],
)
def test_no_usable_cuda_gives_no_profiles(torch_cuda):
    assert _profiles(torch_cuda, FakeNvml([GPUS["A100"]])) == []


def test_this_machine_without_cuda_gives_no_profiles():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert cuda_profiles() == []
    assert gpu_busy(0) == []


def test_gpu_busy_lists_other_processes_only():
    own = os.getpid()
    gpu = replace(GPUS["H100"], processes=(4242, own, 17, 4242))
    nvml = FakeNvml([GPUS["A100"], gpu])
    assert gpu_busy(1, nvml) == [17, 4242]
    assert gpu_busy(0, nvml) == []
    assert gpu_busy(7, nvml, uuid=gpu.uuid) == [17, 4242]  # uuid wins over index
    assert gpu_busy(0, nvml, uuid=gpu.uuid.removeprefix("GPU-")) == [17, 4242]
    assert nvml.inits == nvml.shutdowns == 4


@pytest.mark.parametrize(
    "nvml, index",
    [
        (FakeNvml([GPUS["A100"]], init_error=True), 0),
        (FakeNvml([GPUS["A100"]]), 5),
        (FakeNvml([GPUS["A100"]], failing=frozenset({"nvmlDeviceGetComputeRunningProcesses"})), 0),
    ],
    ids=["no-nvml", "bad-index", "query-fails"],
)
def test_gpu_busy_unknown_is_empty(nvml, index):
    assert gpu_busy(index, nvml) == []


def _top_level_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_probes_import_neither_torch_nor_pynvml_at_module_level():
    for path in sorted(PROBES_DIR.glob("*.py")):
        assert not _top_level_imports(path) & {"torch", "pynvml"}, path.name


def test_only_the_nvml_module_mentions_pynvml_imports():
    for path in sorted(PROBES_DIR.glob("*.py")):
        imports_pynvml = any(
            isinstance(node, (ast.Import, ast.ImportFrom))
            and any(
                name.startswith("pynvml")
                for name in (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                )
            )
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        )
        assert imports_pynvml == (path.name == "_nvml.py"), path.name


# --- MIG ---------------------------------------------------------------------------------------

MIB = 1024**2


def _mig_machine():
    """An H100 split into MIG instances in slots 0 and 2; torch sees the instances."""
    from fakes import FakeMigNvml

    parent = replace(GPUS["H100"], mig_mode=1, sm_clock=1755)
    small = replace(parent, uuid="MIG-5c0e7c1a-4d2b-5f3e-8a9b-0c1d2e3f4a5b", memory_total=9984 * MIB,
                    memory_free=9000 * MIB, processes=(4242,))
    large = replace(parent, uuid="MIG-a1b2c3d4-0000-5f3e-8a9b-0c1d2e3f4a5b", memory_total=40192 * MIB,
                    memory_free=39000 * MIB)
    return parent, small, large, FakeMigNvml([parent], mig={0: (small, None, large)})


def test_mig_instances_pair_with_their_nvml_instances(monkeypatch):
    parent, small, large, nvml = _mig_machine()
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{large.uuid},{small.uuid}")
    first, second = _profiles(FakeTorchCuda([large, small]), nvml)
    assert first.mig_enabled is True and second.mig_enabled is True
    assert first.uuid == large.uuid and second.uuid == small.uuid
    assert first.memory_total == large.memory_total  # CUDA's view of the slice
    assert first.memory_free == large.free and second.memory_free == small.free  # the slice's, not the GPU's
    assert first.clocks_mhz == second.clocks_mhz == (1755, parent.sm_clock_max)  # GPU-wide, from the parent
    assert nvml.inits == nvml.shutdowns == 1


def test_a_mig_uuid_without_its_prefix_pairs_too(monkeypatch):
    _, small, _, nvml = _mig_machine()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    bare = replace(small, uuid=small.uuid.removeprefix("MIG-"))
    (profile,) = _profiles(FakeTorchCuda([bare]), nvml)
    assert profile.mig_enabled is True and profile.memory_free == small.free
    assert profile.uuid == small.uuid  # NVML's spelling


def test_gpu_busy_on_a_mig_instance_lists_that_instance_only():
    _, small, large, nvml = _mig_machine()
    nobody = probes._nvml.OwnProcesses(pid=1, tree=frozenset({1}), gpu_users=0, host_namespace=True)
    assert gpu_busy(0, nvml, uuid=small.uuid, own=nobody) == [4242]
    assert gpu_busy(0, nvml, uuid=large.uuid, own=nobody) == []


# --- our own processes, in a container or not ----------------------------------------------------

HOST_NAMESPACE = 0xEFFFFFFC  # Linux's PROC_PID_INIT_INO
CONTAINER_NAMESPACE = 4026532448


def _fake_proc(tmp_path, *, me: int, namespace: int, processes: dict[int, tuple[int, bool]]):
    """A /proc with ``pid -> (parent pid, holds an NVIDIA GPU device open)``."""
    proc = tmp_path / "proc"
    for pid, (ppid, gpu) in processes.items():
        (proc / str(pid) / "fd").mkdir(parents=True)
        (proc / str(pid) / "stat").write_text(f"{pid} (python3 (x) y) S {ppid} {pid} {pid} 0 -1 4194560 0\n")
        os.symlink("/dev/null", proc / str(pid) / "fd" / "0")
        if gpu:
            os.symlink("/dev/nvidiactl", proc / str(pid) / "fd" / "4")
            os.symlink("/dev/nvidia0", proc / str(pid) / "fd" / "5")
    (proc / str(me) / "ns").mkdir()
    os.symlink(f"pid:[{namespace}]", proc / str(me) / "ns" / "pid")
    os.symlink(str(me), proc / "self")
    return proc


def test_own_processes_are_this_process_its_ancestors_and_descendants(tmp_path):
    # 1 init; 10 a shell; 20 us; 21 and 22 our trial children (21 on the GPU); 30 someone else.
    proc = _fake_proc(tmp_path, me=20, namespace=HOST_NAMESPACE, processes={
        1: (0, False), 10: (1, False), 20: (10, True), 21: (20, True), 22: (20, False), 30: (1, True)})
    own = probes._nvml.own_processes(proc)
    assert own.pid == 20 and own.tree == frozenset({1, 10, 20, 21, 22})
    assert own.gpu_users == 2 and own.host_namespace


def test_gpu_busy_leaves_out_our_own_tree(tmp_path):
    proc = _fake_proc(tmp_path, me=20, namespace=HOST_NAMESPACE, processes={
        1: (0, False), 10: (1, True), 20: (10, True), 21: (20, True), 30: (1, True)})
    own = probes._nvml.own_processes(proc)
    nvml = FakeNvml([replace(GPUS["H100"], processes=(10, 20, 21))])
    assert gpu_busy(0, nvml, own=own) == []  # a parent waits for us: waiting on it never ends
    nvml = FakeNvml([replace(GPUS["H100"], processes=(20, 21, 30))])
    assert gpu_busy(0, nvml, own=own) == [30]


def test_in_a_container_our_own_host_pids_are_not_someone_else(tmp_path):
    # NVML reports host PIDs (here 91020 and 91021 are us and our trial child); our PID
    # namespace is another, so no PID matches, and only the count can tell.
    proc = _fake_proc(tmp_path, me=20, namespace=CONTAINER_NAMESPACE, processes={
        1: (0, False), 20: (1, True), 21: (20, True)})
    own = probes._nvml.own_processes(proc)
    assert not own.host_namespace and own.gpu_users == 2
    assert gpu_busy(0, FakeNvml([replace(GPUS["H100"], processes=(91020, 91021))]), own=own) == []
    busy = FakeNvml([replace(GPUS["H100"], processes=(91020, 91021, 55555))])
    assert gpu_busy(0, busy, own=own) == [55555, 91020, 91021]  # someone else too: which, NVML cannot say


def test_without_proc_only_this_process_is_ours(tmp_path):
    own = probes._nvml.own_processes(tmp_path / "no-proc")
    assert own.pid == os.getpid() and own.tree == frozenset({os.getpid()}) and own.host_namespace
