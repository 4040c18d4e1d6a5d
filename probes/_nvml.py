"""CUDA devices as HardwareProfiles, from torch.cuda plus NVML (the only pynvml importer).

No GPU, no driver, no NVML library, a driver/library mismatch: all are normal on the machines
this runs on (laptops, CPU CI, containers without ``--gpus``), so nothing here raises. Facts
that cannot be read are ``None``; devices that cannot be read at all are left out.

torch.cuda and NVML number devices differently: torch honours ``CUDA_VISIBLE_DEVICES`` and
``CUDA_DEVICE_ORDER``, NVML always lists every GPU in PCI order. Devices are therefore paired
by UUID, and by index only when both sides see the same number of devices and nothing
remaps them.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from probes._libraries import fp8_library_versions
from probes._profile import HardwareProfile

__all__ = ["cuda_profiles", "gpu_busy"]

# pynvml's NVML_CLOCK_SM; used when a binding does not export the constant.
_NVML_CLOCK_SM = 1
_NVML_DEVICE_MIG_ENABLE = 1


def cuda_profiles(
    *,
    torch_cuda: Any = None,
    nvml: Any = None,
    cuda_runtime: str | None = None,
    torch_version: str | None = None,
) -> list[HardwareProfile]:
    """One profile per visible CUDA device, in torch's device order.

    Args:
        torch_cuda: an object with ``torch.cuda``'s ``is_available``, ``device_count`` and
            ``get_device_properties``; ``None`` uses ``torch.cuda``. Tests pass a fake.
        nvml: a module with pynvml's functions; ``None`` imports ``pynvml``. Tests pass a fake.
        cuda_runtime: CUDA runtime version to record; ``None`` reads ``torch.version.cuda``.
        torch_version: torch version to record; ``None`` reads ``torch.__version__``.

    Returns:
        Profiles with ``kind="cuda"``; ``[]`` when there is no usable CUDA. NVML facts
        (driver, free memory, MIG, clocks, UUID) are ``None`` where NVML is unavailable.
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
    profiles = []
    with _nvml_session(nvml) as session:
        driver_version = session.driver_version() if session else None
        handles = session.match_handles(devices) if session else {}
        for index, props in devices:
            handle = handles.get(index)
            facts = session.device_facts(handle) if session and handle is not None else {}
            profiles.append(
                HardwareProfile(
                    kind="cuda",
                    name=str(props.name),
                    index=index,
                    compute_capability=(int(props.major), int(props.minor)),
                    sm_count=int(props.multi_processor_count),
                    # CUDA's view, not NVML's: under MIG it is the slice, which is what a
                    # training process can use.
                    memory_total=int(props.total_memory),
                    memory_free=facts.get("memory_free"),
                    driver_version=driver_version,
                    cuda_runtime=cuda_runtime,
                    mig_enabled=facts.get("mig_enabled"),
                    clocks_mhz=facts.get("clocks_mhz"),
                    torch_version=torch_version,
                    libraries=libraries,
                    uuid=facts.get("uuid") or _torch_uuid(props),
                )
            )
    return profiles


def gpu_busy(index: int, nvml: Any = None, *, uuid: str | None = None) -> list[int]:
    """PIDs of other processes running compute work on a GPU; ``[]`` when none or unknown.

    Args:
        index: NVML device index (PCI order; differs from torch's index when
            ``CUDA_VISIBLE_DEVICES`` is set, so prefer ``uuid``).
        nvml: a module with pynvml's functions; ``None`` imports ``pynvml``.
        uuid: the GPU's UUID (``HardwareProfile.uuid``); when given it selects the device
            and ``index`` is ignored.

    Returns:
        Sorted PIDs, without this process's own.
    """
    with _nvml_session(nvml) as session:
        if session is None:
            return []
        if uuid is not None:
            handle = session.handle_by_uuid(uuid)
        else:
            handle = session.call("nvmlDeviceGetHandleByIndex", index)
        if handle is None:
            return []
        processes = session.call("nvmlDeviceGetComputeRunningProcesses", handle) or []
        own = os.getpid()
        pids = {int(p.pid) for p in processes if getattr(p, "pid", None) is not None}
        return sorted(pid for pid in pids if pid != own)


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


def _normalise_uuid(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        value = value.decode("ascii", errors="replace")
    text = str(value).strip().lower()
    # NVML prefixes "GPU-" (or "MIG-"); torch's cudaDeviceProp.uuid prints without it.
    for prefix in ("gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    return text or None


def _torch_uuid(props: Any) -> str | None:
    """torch's UUID for a device NVML could not describe, in NVML's ``GPU-...`` spelling."""
    raw = _as_text(getattr(props, "uuid", None))
    if not raw or not raw.strip():
        return None
    raw = raw.strip()
    return raw if raw.lower().startswith(("gpu-", "mig-")) else f"GPU-{raw}"


def _as_text(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("ascii", errors="replace")
    return str(value)


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

    def driver_version(self) -> str | None:
        return _as_text(self.call("nvmlSystemGetDriverVersion"))

    def all_handles(self) -> list[tuple[Any, str | None]]:
        count = self.call("nvmlDeviceGetCount")
        handles = []
        for nvml_index in range(int(count or 0)):
            handle = self.call("nvmlDeviceGetHandleByIndex", nvml_index)
            if handle is not None:
                uuid = _normalise_uuid(self.call("nvmlDeviceGetUUID", handle))
                handles.append((handle, uuid))
        return handles

    def handle_by_uuid(self, uuid: str) -> Any:
        wanted = _normalise_uuid(uuid)
        for handle, handle_uuid in self.all_handles():
            if handle_uuid is not None and handle_uuid == wanted:
                return handle
        return None

    def match_handles(self, devices: list[tuple[int, Any]]) -> dict[int, Any]:
        """torch device index -> NVML handle, by UUID, else by index when that is safe."""
        handles = self.all_handles()
        by_uuid = {uuid: handle for handle, uuid in handles if uuid is not None}
        torch_uuids = {
            index: _normalise_uuid(getattr(props, "uuid", None)) for index, props in devices
        }
        if any(torch_uuids.values()):
            # A UUID that NVML does not list is a MIG instance (its "MIG-" UUID is not the
            # parent GPU's): leave it unpaired rather than guess.
            return {i: by_uuid[u] for i, u in torch_uuids.items() if u is not None and u in by_uuid}
        # torch without device UUIDs: pair by position when nothing can have reordered them.
        remapped = "CUDA_VISIBLE_DEVICES" in os.environ
        if not remapped and len(handles) == len(devices):
            return {index: handles[index][0] for index, _ in devices}
        return {}

    def device_facts(self, handle: Any) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        memory = self.call("nvmlDeviceGetMemoryInfo", handle)
        if memory is not None and getattr(memory, "free", None) is not None:
            facts["memory_free"] = int(memory.free)
        mig = self.call("nvmlDeviceGetMigMode", handle)
        if isinstance(mig, (tuple, list)) and mig:
            facts["mig_enabled"] = int(mig[0]) == getattr(
                self.nvml, "NVML_DEVICE_MIG_ENABLE", _NVML_DEVICE_MIG_ENABLE
            )
        clock_sm = getattr(self.nvml, "NVML_CLOCK_SM", _NVML_CLOCK_SM)
        current = self.call("nvmlDeviceGetClockInfo", handle, clock_sm)
        maximum = self.call("nvmlDeviceGetMaxClockInfo", handle, clock_sm)
        if current is not None and maximum is not None:
            facts["clocks_mhz"] = (int(current), int(maximum))
        uuid = _as_text(self.call("nvmlDeviceGetUUID", handle))
        if uuid:
            facts["uuid"] = uuid
        return facts


@contextlib.contextmanager
def _nvml_session(nvml: Any) -> Iterator[_NvmlSession | None]:
    """An initialised NVML for the duration of the block, or ``None`` where there is none."""
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
