"""CUDA devices as HardwareProfiles, from torch.cuda plus NVML (the only pynvml importer).

A missing GPU, driver or NVML is normal here, so nothing raises: unreadable facts are ``None``.
torch honours ``CUDA_VISIBLE_DEVICES`` and NVML lists every GPU in PCI order, so devices are
paired by UUID (MIG instances under their parent GPU), by index only when nothing remaps them."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probes._libraries import fp8_library_versions, gpu_driver_present, torch_release
from probes._profile import HardwareProfile

_PROC = Path("/proc")
# The inode of the initial PID namespace (PROC_PID_INIT_INO in Linux's include/linux/proc_ns.h):
# the NVIDIA driver reports the PIDs of GPU processes as that namespace numbers them.
_INIT_PID_NAMESPACE = 0xEFFFFFFC
# A GPU's device file (/dev/nvidia0...), not the control or UVM ones every CUDA process opens.
_GPU_DEVICE_FILE = re.compile(r"/dev/nvidia\d+")


def cuda_profiles(*, torch_cuda: Any = None, nvml: Any = None, cuda_runtime: str | None = None,
                  torch_version: str | None = None) -> list[HardwareProfile]:
    """One profile per visible CUDA device, in torch's order; ``[]`` without usable CUDA.

    Tests pass fakes; without ``torch_cuda`` the torch facts are read from torch, which is not
    imported where no GPU driver is (a CPU-only host answers at once)."""
    if torch_cuda is None:
        if not gpu_driver_present():
            return []
        try:
            import torch
        except ImportError:
            return []
        torch_cuda, cuda_runtime, torch_version = torch.cuda, torch.version.cuda, torch_release()
    devices = _torch_devices(torch_cuda)
    if not devices:
        return []
    libraries = fp8_library_versions()
    arch_list: tuple[str, ...] = ()  # a stand-in without get_arch_list, or a build that cannot tell
    with contextlib.suppress(Exception):
        arch_list = tuple(str(arch) for arch in torch_cuda.get_arch_list())
    profiles = []
    with _nvml_session(nvml) as session:
        driver_version = _as_text(session.call("nvmlSystemGetDriverVersion")) if session else None
        handles = session.match_handles(devices) if session else {}
        for index, props in devices:
            facts = session.device_facts(*handles[index]) if index in handles else {}
            profiles.append(HardwareProfile(
                kind="cuda", name=str(props.name), index=index, compute_capability=(int(props.major), int(props.minor)),
                sm_count=int(props.multi_processor_count),
                # CUDA's view, not NVML's: under MIG it is the slice, which is what training can use.
                memory_total=int(props.total_memory), memory_free=facts.get("memory_free"),
                driver_version=driver_version, cuda_runtime=cuda_runtime, mig_enabled=facts.get("mig_enabled"),
                clocks_mhz=facts.get("clocks_mhz"), torch_version=torch_version, libraries=libraries,
                uuid=facts.get("uuid") or _torch_uuid(props), cuda_arch_list=arch_list,
            ))
    return profiles


def gpu_busy(index: int, nvml: Any = None, *, uuid: str | None = None, own: OwnProcesses | None = None) -> list[int]:
    """Sorted PIDs of other processes computing on a GPU (not this process's own tree); ``[]``
    when none or unknown. ``uuid`` (a GPU's or MIG instance's) selects the device, else ``index``
    in NVML's PCI order, which differs from torch's under ``CUDA_VISIBLE_DEVICES``.

    In a container NVML still reports host PIDs, ours among them under numbers we cannot see.
    Our tree accounts for at most ``own.gpu_users`` entries, so a list no longer than that is
    ours; a longer one is returned whole, since which entry is someone else's cannot be told."""
    with _nvml_session(nvml) as session:
        if session is None:
            return []
        handle = session.handle_by_uuid(uuid) if uuid is not None else session.call("nvmlDeviceGetHandleByIndex", index)
        if handle is None:
            return []
        processes = session.call("nvmlDeviceGetComputeRunningProcesses", handle) or []
        pids = {int(p.pid) for p in processes if getattr(p, "pid", None) is not None}
    if not pids:
        return []
    own = own if own is not None else own_processes()
    return sorted(pids - own.tree) if own.host_namespace or len(pids) > own.gpu_users else []


@dataclass(frozen=True)
class OwnProcesses:
    """This process's own tree: its ancestors (they wait for it, so waiting on them never ends)
    and descendants (its trials); ``gpu_users`` of them hold a GPU device file open, and
    ``host_namespace`` says whether these PIDs are numbered as NVML numbers them."""

    pid: int
    tree: frozenset[int]
    gpu_users: int = 0
    host_namespace: bool = True


def own_processes(proc: Path = _PROC) -> OwnProcesses:
    """This process's own tree as ``/proc`` shows it; this process alone where there is none."""
    pid = os.getpid()
    with contextlib.suppress(OSError, ValueError):
        pid = int(os.readlink(proc / "self"))
    parents, tree = _parent_pids(proc), {pid}
    while children := {child for child, parent in parents.items() if parent in tree} - tree:
        tree |= children  # the descendants
    current = parents.get(pid)
    while current and current not in tree:  # the ancestors
        tree.add(current)
        current = parents.get(current)
    namespace = None  # not Linux, or no /proc: nothing says the PIDs differ
    with contextlib.suppress(OSError):
        namespace = re.fullmatch(r"pid:\[(\d+)\]", os.readlink(proc / "self" / "ns" / "pid"))
    return OwnProcesses(pid=pid, tree=frozenset(tree),
                        gpu_users=sum(_holds_gpu(proc, member) for member in tree),
                        host_namespace=not namespace or int(namespace[1]) == _INIT_PID_NAMESPACE)


def _parent_pids(proc: Path) -> dict[int, int]:
    parents = {}
    with contextlib.suppress(OSError):  # no /proc
        for name in filter(str.isdigit, os.listdir(proc)):
            with contextlib.suppress(OSError):  # it ended meanwhile
                stat = (proc / name / "stat").read_text()
                # "pid (comm) state ppid ...": comm may hold ")", so read after the last ")".
                fields = stat[stat.rfind(")") + 1 :].split()
                if len(fields) > 1 and fields[1].isdigit():
                    parents[int(name)] = int(fields[1])
    return parents


def _holds_gpu(proc: Path, pid: int) -> bool:
    fds = proc / str(pid) / "fd"
    with contextlib.suppress(OSError):  # another user's process, or it ended
        for name in os.listdir(fds):
            with contextlib.suppress(OSError):
                if _GPU_DEVICE_FILE.fullmatch(os.readlink(fds / name)):
                    return True
    return False


def _torch_devices(torch_cuda: Any) -> list[tuple[int, Any]]:
    # A broken driver makes these raise RuntimeError (or worse) rather than report False;
    # that is still "no usable CUDA" to a probe.
    try:
        count = int(torch_cuda.device_count()) if torch_cuda.is_available() else 0
    except Exception:
        return []
    devices = []
    for index in range(count):
        with contextlib.suppress(Exception):
            devices.append((index, torch_cuda.get_device_properties(index)))
    return devices


def _normalise_uuid(value: object) -> str | None:
    # NVML prefixes "GPU-" (or "MIG-"); torch's cudaDeviceProp.uuid prints without it.
    return (_as_text(value) or "").strip().lower().removeprefix("gpu-").removeprefix("mig-") or None


def _torch_uuid(props: Any) -> str | None:
    """torch's UUID, in NVML's ``GPU-...`` spelling."""
    raw = (_as_text(getattr(props, "uuid", None)) or "").strip()
    if raw and not raw.lower().startswith(("gpu-", "mig-")):
        raw = f"GPU-{raw}"
    return raw or None


def _as_text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("ascii", errors="replace")
    return None if value is None else str(value)


class _NvmlSession:
    """Calls into an initialised NVML; every failure reads as ``None``, never raises."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def call(self, function: str, *args: Any) -> Any:
        # pynvml raises a different NVMLError subclass per return code (NotSupported on consumer
        # cards, NoPermission in containers, GpuIsLost...), ctypes can raise OSError, and an old
        # binding lacks the function: the fact is unknown.
        with contextlib.suppress(Exception):
            return getattr(self.nvml, function)(*args)
        return None

    def gpus(self) -> list[Any]:
        count = int(self.call("nvmlDeviceGetCount") or 0)
        handles = (self.call("nvmlDeviceGetHandleByIndex", index) for index in range(count))
        return [handle for handle in handles if handle is not None]

    def mig_enabled(self, handle: Any) -> bool | None:
        mig = self.call("nvmlDeviceGetMigMode", handle)  # [current, pending]
        if isinstance(mig, (tuple, list)) and mig:
            return int(mig[0]) == getattr(self.nvml, "NVML_DEVICE_MIG_ENABLE", 1)
        return None

    def by_uuid(self) -> dict[str, tuple[Any, Any]]:
        """``(handle, parent GPU's handle or None)`` of every GPU and MIG instance, by UUID."""
        found = {}
        for gpu in self.gpus():
            found[_normalise_uuid(self.call("nvmlDeviceGetUUID", gpu))] = (gpu, None)
            if not self.mig_enabled(gpu):
                continue
            for slot in range(int(self.call("nvmlDeviceGetMaxMigDeviceCount", gpu) or 0)):
                handle = self.call("nvmlDeviceGetMigDeviceHandleByIndex", gpu, slot)
                if handle is not None:  # an empty slot raises NotFound
                    found[_normalise_uuid(self.call("nvmlDeviceGetUUID", handle))] = (handle, gpu)
        found.pop(None, None)
        return found

    def handle_by_uuid(self, uuid: str) -> Any:
        return self.by_uuid().get(_normalise_uuid(uuid), (None, None))[0]

    def match_handles(self, devices: list[tuple[int, Any]]) -> dict[int, tuple[Any, Any]]:
        torch_uuids = {index: _normalise_uuid(getattr(props, "uuid", None)) for index, props in devices}
        if any(torch_uuids.values()):
            # Under MIG, torch's UUID is the instance's ("MIG-..."), which NVML lists under its
            # parent GPU. A UUID NVML lists nowhere stays unpaired rather than guessed.
            known = self.by_uuid()
            return {index: known[uuid] for index, uuid in torch_uuids.items() if uuid in known}
        # torch without device UUIDs: pair by position when nothing can have reordered them.
        gpus = self.gpus()
        if "CUDA_VISIBLE_DEVICES" in os.environ or len(gpus) != len(devices):
            return {}
        return {index: (gpus[index], None) for index, _ in devices}

    def device_facts(self, handle: Any, parent: Any = None) -> dict[str, Any]:
        if parent is not None:
            # A MIG instance: the GPU-wide facts (clocks) only the parent answers; memory and
            # UUID are the instance's own.
            whole_gpu = {k: v for k, v in self.device_facts(parent).items() if k == "clocks_mhz"}
            return {**whole_gpu, **self.device_facts(handle), "mig_enabled": True}
        free = getattr(self.call("nvmlDeviceGetMemoryInfo", handle), "free", None)
        clock_sm = getattr(self.nvml, "NVML_CLOCK_SM", 1)
        clocks = [self.call(query, handle, clock_sm)
                  for query in ("nvmlDeviceGetClockInfo", "nvmlDeviceGetMaxClockInfo")]
        facts = {
            "memory_free": None if free is None else int(free),
            "mig_enabled": self.mig_enabled(handle),
            "clocks_mhz": None if None in clocks else tuple(int(clock) for clock in clocks),
            "uuid": _as_text(self.call("nvmlDeviceGetUUID", handle)) or None,
        }
        return {key: value for key, value in facts.items() if value is not None}


@contextlib.contextmanager
def _nvml_session(nvml: Any) -> Iterator[_NvmlSession | None]:
    try:
        if nvml is None:
            import pynvml as nvml
        nvml.nvmlInit()
    except Exception:
        # No nvidia-ml-py (some old bindings fail on import with other errors when libnvidia-ml
        # is missing), or NVMLError_LibraryNotFound / DriverNotLoaded without a driver.
        yield None
        return
    try:
        yield _NvmlSession(nvml)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
