"""CUDA devices as HardwareProfiles, from torch.cuda plus NVML (the only pynvml importer).

A missing GPU, driver or NVML is normal here, so nothing raises: unreadable facts are ``None``.
torch honours ``CUDA_VISIBLE_DEVICES`` and NVML lists every GPU in PCI order, so devices are
paired by UUID (MIG instances under their parent GPU), by index only when nothing remaps them.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from probes._libraries import fp8_library_versions
from probes._profile import HardwareProfile

# pynvml's NVML_CLOCK_SM; used when a binding does not export the constant.
_NVML_CLOCK_SM = 1
_NVML_DEVICE_MIG_ENABLE = 1
# Where this process's own tree is read (Linux).
_PROC = Path("/proc")
# The inode of the initial PID namespace (PROC_PID_INIT_INO in Linux's include/linux/proc_ns.h):
# the NVIDIA driver reports the PIDs of GPU processes as that namespace numbers them.
_INIT_PID_NAMESPACE = 0xEFFFFFFC
# A GPU's device file (/dev/nvidia0...), not the control or UVM ones every CUDA process opens.
_GPU_DEVICE_FILE = re.compile(r"/dev/nvidia\d+")


def cuda_profiles(*, torch_cuda: Any = None, nvml: Any = None, cuda_runtime: str | None = None,
                  torch_version: str | None = None) -> list[HardwareProfile]:
    """One profile per visible CUDA device, in torch's order; ``[]`` without usable CUDA.

    Each argument left ``None`` is read from torch (or pynvml); tests pass fakes.
    """
    if torch_cuda is None or cuda_runtime is None or torch_version is None:
        try:
            import torch
        except ImportError:
            torch = None
        if torch is None and torch_cuda is None:
            return []
        if torch is not None:
            torch_cuda = torch.cuda if torch_cuda is None else torch_cuda
            cuda_runtime = torch.version.cuda if cuda_runtime is None else cuda_runtime
            torch_version = str(torch.__version__) if torch_version is None else torch_version

    devices = _torch_devices(torch_cuda)
    if not devices:
        return []
    libraries = fp8_library_versions()
    arch_list = _arch_list(torch_cuda)
    profiles = []
    with _nvml_session(nvml) as session:
        driver_version = _as_text(session.call("nvmlSystemGetDriverVersion")) if session else None
        handles = session.match_handles(devices) if session else {}
        for index, props in devices:
            handle = handles.get(index)
            facts = session.device_facts(handle) if session and handle is not None else {}
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
    when none or unknown.

    ``uuid`` (a GPU's or MIG instance's), when given, selects the device; else ``index`` does,
    in NVML's PCI order, which differs from torch's under ``CUDA_VISIBLE_DEVICES``.
    """
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
    return other_gpu_processes(pids, own if own is not None else own_processes())


@dataclass(frozen=True)
class OwnProcesses:
    """This process's own tree: GPU work that is never another job's to wait for.

    ``tree`` holds its ancestors (they wait for it, so waiting on them never ends) and its
    descendants (its trials); ``gpu_users`` how many of them hold a GPU device file open;
    ``host_namespace`` whether these PIDs are numbered as NVML numbers them.
    """

    pid: int
    tree: frozenset[int]
    gpu_users: int = 0
    host_namespace: bool = True


def other_gpu_processes(listed: Iterable[int], own: OwnProcesses) -> list[int]:
    """The PIDs on NVML's list that belong to someone else.

    In a container NVML still reports host PIDs, ours among them under numbers we cannot see.
    Our tree accounts for at most ``own.gpu_users`` entries, so a list no longer than that is
    ours; a longer one is returned whole, since which entry is someone else's cannot be told.
    """
    listed = set(listed)
    others = sorted(listed - own.tree)
    if own.host_namespace or len(listed) > own.gpu_users:
        return others
    return []


def own_processes(proc: Path | None = None) -> OwnProcesses:
    """This process's own tree as ``/proc`` shows it; this process alone where there is none."""
    proc = proc or _PROC
    pid = _self_pid(proc)
    parents = _parent_pids(proc)
    tree = {pid} | _ancestors(pid, parents) | _descendants(pid, parents)
    return OwnProcesses(pid=pid, tree=frozenset(tree), gpu_users=sum(_holds_gpu(proc, member) for member in tree),
                        host_namespace=_in_host_namespace(proc))


def _self_pid(proc: Path) -> int:
    try:
        return int(os.readlink(proc / "self"))
    except (OSError, ValueError):
        return os.getpid()


def _parent_pids(proc: Path) -> dict[int, int]:
    try:
        names = os.listdir(proc)
    except OSError:
        return {}
    parents = {}
    for name in names:
        if not name.isdigit():
            continue
        try:
            stat = (proc / name / "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so read after the last ")".
        fields = stat[stat.rfind(")") + 1 :].split()
        if len(fields) > 1 and fields[1].isdigit():
            parents[int(name)] = int(fields[1])
    return parents


def _ancestors(pid: int, parents: dict[int, int]) -> set[int]:
    found: set[int] = set()
    current = parents.get(pid)
    while current and current not in found:
        found.add(current)
        current = parents.get(current)
    return found


def _descendants(pid: int, parents: dict[int, int]) -> set[int]:
    children: dict[int, list[int]] = {}
    for child, parent in parents.items():
        children.setdefault(parent, []).append(child)
    found: set[int] = set()
    pending = [pid]
    while pending:
        for child in children.get(pending.pop(), ()):
            if child not in found:
                found.add(child)
                pending.append(child)
    return found


def _holds_gpu(proc: Path, pid: int) -> bool:
    fds = proc / str(pid) / "fd"
    try:
        names = os.listdir(fds)
    except OSError:  # another user's process, or it ended
        return False
    for name in names:
        try:
            if _GPU_DEVICE_FILE.fullmatch(os.readlink(fds / name)):
                return True
        except OSError:
            continue
    return False


def _in_host_namespace(proc: Path) -> bool:
    try:
        link = os.readlink(proc / "self" / "ns" / "pid")
    except OSError:  # not Linux, or no /proc: nothing says the PIDs differ
        return True
    match = re.fullmatch(r"pid:\[(\d+)\]", link)
    return match is None or int(match.group(1)) == _INIT_PID_NAMESPACE


def _torch_devices(torch_cuda: Any) -> list[tuple[int, Any]]:
    # A broken driver makes these raise RuntimeError (or worse) rather than report False;
    # that is still "no usable CUDA" to a probe.
    try:
        if not torch_cuda.is_available():
            return []
        count = int(torch_cuda.device_count())
    except Exception:
        return []
    devices = []
    for index in range(count):
        try:
            devices.append((index, torch_cuda.get_device_properties(index)))
        except Exception:
            continue
    return devices


def _arch_list(torch_cuda: Any) -> tuple[str, ...]:
    try:
        return tuple(str(arch) for arch in torch_cuda.get_arch_list())
    except Exception:
        # A stand-in without get_arch_list, or a build that cannot report it: not recorded.
        return ()


def _normalise_uuid(value: object) -> str | None:
    text = (_as_text(value) or "").strip().lower()
    # NVML prefixes "GPU-" (or "MIG-"); torch's cudaDeviceProp.uuid prints without it.
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text or None


def _torch_uuid(props: Any) -> str | None:
    """torch's UUID, in NVML's ``GPU-...`` spelling."""
    raw = (_as_text(getattr(props, "uuid", None)) or "").strip()
    if not raw:
        return None
    return raw if raw.lower().startswith(("gpu-", "mig-")) else f"GPU-{raw}"


def _as_text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("ascii", errors="replace")
    return str(value)


class _MigInstance(NamedTuple):
    handle: Any
    parent: Any


class _NvmlSession:
    """Calls into an initialised NVML; every failure reads as ``None``, never raises."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml

    def call(self, function: str, *args: Any) -> Any:
        method = getattr(self.nvml, function, None)
        if method is None:
            return None
        try:
            return method(*args)
        except Exception:
            # pynvml raises a different NVMLError subclass per return code (NotSupported
            # on consumer cards, NoPermission in containers, GpuIsLost...), and ctypes can
            # raise OSError; any of them only means this fact is unknown.
            return None

    def all_handles(self) -> list[tuple[Any, str | None]]:
        count = self.call("nvmlDeviceGetCount")
        handles = []
        for nvml_index in range(int(count or 0)):
            handle = self.call("nvmlDeviceGetHandleByIndex", nvml_index)
            if handle is not None:
                uuid = _normalise_uuid(self.call("nvmlDeviceGetUUID", handle))
                handles.append((handle, uuid))
        return handles

    def mig_enabled(self, handle: Any) -> bool | None:
        mig = self.call("nvmlDeviceGetMigMode", handle)  # [current, pending]
        if isinstance(mig, (tuple, list)) and mig:
            return int(mig[0]) == getattr(self.nvml, "NVML_DEVICE_MIG_ENABLE", _NVML_DEVICE_MIG_ENABLE)
        return None

    def mig_instances(self, gpus: list[tuple[Any, str | None]]) -> list[tuple[_MigInstance, str | None]]:
        instances = []
        for parent, _ in gpus:
            if not self.mig_enabled(parent):
                continue
            for slot in range(int(self.call("nvmlDeviceGetMaxMigDeviceCount", parent) or 0)):
                handle = self.call("nvmlDeviceGetMigDeviceHandleByIndex", parent, slot)
                if handle is not None:  # an empty slot raises NotFound
                    uuid = _normalise_uuid(self.call("nvmlDeviceGetUUID", handle))
                    instances.append((_MigInstance(handle, parent), uuid))
        return instances

    def handle_by_uuid(self, uuid: str) -> Any:
        wanted = _normalise_uuid(uuid)
        gpus = self.all_handles()
        for handle, handle_uuid in gpus:
            if handle_uuid is not None and handle_uuid == wanted:
                return handle
        for instance, instance_uuid in self.mig_instances(gpus):
            if instance_uuid is not None and instance_uuid == wanted:
                return instance.handle
        return None

    def match_handles(self, devices: list[tuple[int, Any]]) -> dict[int, Any]:
        handles = self.all_handles()
        by_uuid: dict[str, Any] = {uuid: handle for handle, uuid in handles if uuid is not None}
        torch_uuids = {index: _normalise_uuid(getattr(props, "uuid", None)) for index, props in devices}
        if any(torch_uuids.values()):
            # Under MIG, torch's UUID is the instance's ("MIG-..."), which NVML lists under its
            # parent GPU. A UUID NVML lists nowhere stays unpaired rather than guessed.
            if any(u is not None and u not in by_uuid for u in torch_uuids.values()):
                by_uuid.update((u, i) for i, u in self.mig_instances(handles) if u is not None)
            return {i: by_uuid[u] for i, u in torch_uuids.items() if u is not None and u in by_uuid}
        # torch without device UUIDs: pair by position when nothing can have reordered them.
        remapped = "CUDA_VISIBLE_DEVICES" in os.environ
        if not remapped and len(handles) == len(devices):
            return {index: handles[index][0] for index, _ in devices}
        return {}

    def device_facts(self, handle: Any) -> dict[str, Any]:
        if isinstance(handle, _MigInstance):
            return self._instance_facts(handle)
        facts: dict[str, Any] = {}
        memory = self.call("nvmlDeviceGetMemoryInfo", handle)
        if memory is not None and getattr(memory, "free", None) is not None:
            facts["memory_free"] = int(memory.free)
        mig = self.mig_enabled(handle)
        if mig is not None:
            facts["mig_enabled"] = mig
        clock_sm = getattr(self.nvml, "NVML_CLOCK_SM", _NVML_CLOCK_SM)
        current = self.call("nvmlDeviceGetClockInfo", handle, clock_sm)
        maximum = self.call("nvmlDeviceGetMaxClockInfo", handle, clock_sm)
        if current is not None and maximum is not None:
            facts["clocks_mhz"] = (int(current), int(maximum))
        uuid = _as_text(self.call("nvmlDeviceGetUUID", handle))
        if uuid:
            facts["uuid"] = uuid
        return facts

    def _instance_facts(self, instance: _MigInstance) -> dict[str, Any]:
        # The GPU-wide facts (clocks) only the parent answers; memory and UUID are the instance's.
        parent = self.device_facts(instance.parent)
        for whole_gpu in ("memory_free", "uuid"):  # the whole GPU's, not this instance's
            parent.pop(whole_gpu, None)
        return {**parent, **self.device_facts(instance.handle), "mig_enabled": True}


@contextlib.contextmanager
def _nvml_session(nvml: Any) -> Iterator[_NvmlSession | None]:
    if nvml is None:
        try:
            import pynvml as nvml
        except Exception:
            # ImportError without nvidia-ml-py; some old bindings fail on import with
            # other errors when libnvidia-ml is missing.
            yield None
            return
    try:
        nvml.nvmlInit()
    except Exception:
        # NVMLError_LibraryNotFound / DriverNotLoaded on machines without a driver.
        yield None
        return
    try:
        yield _NvmlSession(nvml)
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
