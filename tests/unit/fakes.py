"""Fake ``torch.cuda`` and fake ``pynvml`` for probing GPUs on a machine without one, and the
pieces of Transformer Engine's recipe module that fakes of ``transformer_engine`` share.

The fakes copy the real interfaces' shapes: ``get_device_properties`` returns an object with
``name``, ``major``, ``minor``, ``multi_processor_count``, ``total_memory`` and ``uuid``
(printed without NVML's ``GPU-`` prefix, as torch prints it); the NVML fake raises
``NVMLError`` subclasses the way pynvml does, refuses calls before ``nvmlInit``, and counts
init/shutdown so tests can check they balance. GPU facts are the values the real cards report
(names, SM counts, memory in bytes, max SM clocks).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, replace
from types import SimpleNamespace

import torch
from torch import nn

from probes import HardwareProfile, cuda_profiles

MIB = 1024**2


@dataclass(frozen=True)
class FakeGpu:
    """What one real GPU reports, to both torch.cuda and NVML."""

    name: str
    compute_capability: tuple[int, int]
    sm_count: int
    memory_total: int
    uuid: str  # NVML form, "GPU-..."
    sm_clock_max: int
    sm_clock: int = 210  # idle clock
    memory_free: int | None = None
    mig_mode: int | None = None  # None: NVML says NotSupported (consumer and older cards)
    processes: tuple[int, ...] = ()

    @property
    def free(self) -> int:
        return self.memory_free if self.memory_free is not None else self.memory_total - 512 * MIB


def _uuid(n: int) -> str:
    return f"GPU-{n:08x}-1d2c-4b6e-9f3a-{n:012x}"


GPUS: dict[str, FakeGpu] = {
    "P100": FakeGpu("Tesla P100-PCIE-16GB", (6, 0), 56, 16280 * MIB, _uuid(1), 1328),
    "V100": FakeGpu("Tesla V100-SXM2-16GB", (7, 0), 80, 16160 * MIB, _uuid(2), 1530),
    "T4": FakeGpu("Tesla T4", (7, 5), 40, 15102 * MIB, _uuid(3), 1590),
    "A100": FakeGpu("NVIDIA A100-SXM4-80GB", (8, 0), 108, 81229 * MIB, _uuid(4), 1410, mig_mode=0),
    "RTX 4090": FakeGpu("NVIDIA GeForce RTX 4090", (8, 9), 128, 24217 * MIB, _uuid(5), 3105),
    "L4": FakeGpu("NVIDIA L4", (8, 9), 58, 22488 * MIB, _uuid(6), 2040),
    "H100": FakeGpu("NVIDIA H100 80GB HBM3", (9, 0), 132, 81079 * MIB, _uuid(7), 1980, mig_mode=0),
    "H200": FakeGpu("NVIDIA H200", (9, 0), 132, 143771 * MIB, _uuid(8), 1980, mig_mode=0),
    "B200": FakeGpu("NVIDIA B200", (10, 0), 148, 182642 * MIB, _uuid(9), 1965, mig_mode=0),
}


# --- torch.cuda ------------------------------------------------------------------------------


@dataclass(frozen=True)
class FakeDeviceProperties:
    """Shape of ``torch.cuda.get_device_properties(i)``."""

    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int
    uuid: str | None


class FakeTorchCuda:
    """The parts of ``torch.cuda`` the probes use, over a list of visible GPUs.

    Args:
        gpus: the devices CUDA shows, in CUDA order (after ``CUDA_VISIBLE_DEVICES``).
        available: what ``is_available()`` answers.
        broken: ``is_available()`` raises, as with a driver/runtime mismatch.
        with_uuid: whether device properties carry ``uuid`` (older torch lacks it).
    """

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        available: bool = True,
        broken: bool = False,
        with_uuid: bool = True,
    ) -> None:
        self.gpus = list(gpus)
        self.available = available
        self.broken = broken
        self.with_uuid = with_uuid

    def is_available(self) -> bool:
        if self.broken:
            raise RuntimeError("CUDA driver initialization failed, you might not have a CUDA gpu.")
        return self.available and bool(self.gpus)

    def device_count(self) -> int:
        return len(self.gpus) if self.available else 0

    def get_device_properties(self, index: int) -> FakeDeviceProperties:
        if not 0 <= index < len(self.gpus):
            raise AssertionError("Invalid device id")  # what torch raises
        gpu = self.gpus[index]
        major, minor = gpu.compute_capability
        uuid = gpu.uuid.removeprefix("GPU-") if self.with_uuid else None
        return FakeDeviceProperties(gpu.name, major, minor, gpu.sm_count, gpu.memory_total, uuid)

    def get_device_capability(self, index: int = 0) -> tuple[int, int]:
        return self.gpus[index].compute_capability

    def is_bf16_supported(self) -> bool:
        # The real function answers True on any CUDA device because bf16 can be emulated:
        # the reason the support table does not ask it.
        return self.is_available()


# --- pynvml ----------------------------------------------------------------------------------


class NVMLError(Exception):
    """pynvml's base error; subclasses per return code."""

    def __init__(self, value: int = 999, message: str = "Unknown Error") -> None:
        super().__init__(message)
        self.value = value


class NVMLError_Uninitialized(NVMLError):  # noqa: N801 - pynvml's own name
    def __init__(self) -> None:
        super().__init__(1, "Uninitialized")


class NVMLError_NotSupported(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(3, "Not Supported")


class NVMLError_InvalidArgument(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(2, "Invalid Argument")


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(12, "NVML Shared Library Not Found")


@dataclass(frozen=True)
class _Handle:
    index: int


@dataclass
class FakeNvml:
    """A stand-in for the ``pynvml`` module over every GPU in the machine (PCI order).

    Args:
        gpus: all GPUs NVML sees (it ignores ``CUDA_VISIBLE_DEVICES``).
        driver: driver version string.
        init_error: ``nvmlInit`` raises ``NVMLError_LibraryNotFound``, as on a machine
            without the NVIDIA driver.
        failing: names of functions that raise ``NVMLError_NotSupported``.
    """

    gpus: list[FakeGpu]
    driver: str = "550.54.15"
    init_error: bool = False
    failing: frozenset[str] = frozenset()
    inits: int = 0
    shutdowns: int = 0
    calls: list[str] = field(default_factory=list)

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_DEVICE_MIG_ENABLE = 1

    def _enter(self, function: str) -> None:
        self.calls.append(function)
        if self.inits <= self.shutdowns:
            raise NVMLError_Uninitialized()
        if function in self.failing:
            raise NVMLError_NotSupported()

    def _gpu(self, handle: _Handle) -> FakeGpu:
        return self.gpus[handle.index]

    def nvmlInit(self) -> None:  # noqa: N802 - pynvml's names
        self.calls.append("nvmlInit")
        if self.init_error:
            raise NVMLError_LibraryNotFound()
        self.inits += 1

    def nvmlShutdown(self) -> None:  # noqa: N802
        self._enter("nvmlShutdown")
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:  # noqa: N802
        self._enter("nvmlSystemGetDriverVersion")
        return self.driver

    def nvmlDeviceGetCount(self) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:  # noqa: N802
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str:  # noqa: N802
        self._enter("nvmlDeviceGetUUID")
        return self._gpu(handle).uuid

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> SimpleNamespace:  # noqa: N802
        self._enter("nvmlDeviceGetMemoryInfo")
        gpu = self._gpu(handle)
        return SimpleNamespace(
            total=gpu.memory_total, free=gpu.free, used=gpu.memory_total - gpu.free
        )

    def nvmlDeviceGetMigMode(self, handle: _Handle) -> list[int]:  # noqa: N802
        self._enter("nvmlDeviceGetMigMode")
        gpu = self._gpu(handle)
        if gpu.mig_mode is None:
            raise NVMLError_NotSupported()
        return [gpu.mig_mode, gpu.mig_mode]

    def nvmlDeviceGetClockInfo(self, handle: _Handle, clock_type: int) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetClockInfo")
        if clock_type != self.NVML_CLOCK_SM:
            raise NVMLError_InvalidArgument()
        return self._gpu(handle).sm_clock

    def nvmlDeviceGetMaxClockInfo(self, handle: _Handle, clock_type: int) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetMaxClockInfo")
        if clock_type != self.NVML_CLOCK_SM:
            raise NVMLError_InvalidArgument()
        return self._gpu(handle).sm_clock_max

    def nvmlDeviceGetComputeRunningProcesses(  # noqa: N802
        self, handle: _Handle
    ) -> list[SimpleNamespace]:
        self._enter("nvmlDeviceGetComputeRunningProcesses")
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=1024 * MIB)
            for pid in self._gpu(handle).processes
        ]


# --- profiles --------------------------------------------------------------------------------

CUDA_RUNTIME = "12.4"
TORCH_VERSION = "2.5.1+cu124"
WITH_FP8_LIBRARIES = (("torchao", "0.10.0"), ("transformer_engine", "2.1.0"))
WITHOUT_FP8_LIBRARIES = (("torchao", None), ("transformer_engine", None))


def gpu_profile(
    key: str, *, libraries: tuple[tuple[str, str | None], ...] = WITH_FP8_LIBRARIES
) -> HardwareProfile:
    """The profile ``cuda_profiles`` builds for one fake GPU, with the given FP8 libraries."""
    gpu = GPUS[key]
    profiles = cuda_profiles(
        torch_cuda=FakeTorchCuda([gpu]),
        nvml=FakeNvml([gpu]),
        cuda_runtime=CUDA_RUNTIME,
        torch_version=TORCH_VERSION,
    )
    if len(profiles) != 1:
        raise RuntimeError(f"expected one profile for {key}, got {profiles!r}")
    return replace(profiles[0], libraries=libraries)


class Net(nn.Module):
    """A tiny MLP whose hidden width changes its structure (and so its model signature)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Linear(hidden, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


# --- torch.cuda's devices, streams and events, for a trial's timing ------------------------


@dataclass(frozen=True)
class FakeStream:
    """Shape of ``torch.cuda.Stream``: the device it belongs to."""

    device: torch.device


class FakeCudaEvent:
    """Shape of ``torch.cuda.Event``: ``record`` stamps when the stream's device will have
    finished the work queued so far; ``elapsed_time`` refuses events of two devices, as
    ``cudaEventElapsedTime`` does."""

    def __init__(self, cuda: FakeCudaTimeline, enable_timing: bool = False, **_: object) -> None:
        self.cuda = cuda
        self.enable_timing = enable_timing
        self.device: torch.device | None = None
        self.at: float | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.cuda.current_stream()
        self.device = stream.device
        self.at = self.cuda.busy_until[stream.device.index]

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        if self.at is None or end.at is None:
            raise RuntimeError("CUDA error: device not ready")
        if self.device != end.device:
            raise RuntimeError("CUDA error: invalid resource handle")  # events of two devices
        return (end.at - self.at) * 1e3  # milliseconds


class FakeCudaTimeline:
    """The parts of ``torch.cuda`` a trial uses, over devices whose queued work is simulated.

    Each device has a clock of the GPU time its queued work takes (``run(device, seconds)``
    queues work there); an event records that clock on its stream's device. A call without a
    device means the current one, as in torch, which starts at 0.

    Args:
        count: how many devices CUDA shows.
    """

    def __init__(self, count: int = 2) -> None:
        self.count = count
        self.current = 0
        self.busy_until = [0.0] * count
        self.synchronized: list[int] = []  # the device of each synchronize() call
        self.set_devices: list[int] = []

    def index(self, device: object = None) -> int:
        if device is None:
            return self.current
        if isinstance(device, int):
            return device
        device = torch.device(device)
        return self.current if device.index is None else device.index

    def run(self, device: int, seconds: float) -> None:
        """Queue ``seconds`` of work on ``device``."""
        self.busy_until[device] += seconds

    def set_device(self, device: object) -> None:
        self.current = self.index(device)
        self.set_devices.append(self.current)

    def current_device(self) -> int:
        return self.current

    def current_stream(self, device: object = None) -> FakeStream:
        return FakeStream(torch.device("cuda", self.index(device)))

    def synchronize(self, device: object = None) -> None:
        self.synchronized.append(self.index(device))

    def event(self, enable_timing: bool = False, **kwargs: object) -> FakeCudaEvent:
        return FakeCudaEvent(self, enable_timing, **kwargs)

    def install(self, monkeypatch: object) -> FakeCudaTimeline:
        """Stand in for ``torch.cuda``'s functions for the rest of the test."""
        for name, value in {
            "is_available": lambda: True,
            "device_count": lambda: self.count,
            "set_device": self.set_device,
            "current_device": self.current_device,
            "current_stream": self.current_stream,
            "synchronize": self.synchronize,
            "Event": self.event,
            "reset_peak_memory_stats": lambda device=None: None,
            "max_memory_allocated": lambda device=None: 64 * MIB,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
        return self


# --- NVML with MIG instances -----------------------------------------------------------------


class NVMLError_NotFound(NVMLError):  # noqa: N801
    def __init__(self) -> None:
        super().__init__(6, "Not Found")


@dataclass(frozen=True)
class _MigHandle:
    parent: int
    slot: int


@dataclass
class FakeMigNvml(FakeNvml):
    """``FakeNvml`` whose GPUs may be split into MIG instances.

    Args:
        mig: NVML parent index -> the instances in its slots (``None`` for an empty slot),
            each a ``FakeGpu`` with the instance's "MIG-..." UUID, memory and processes.
            NVML answers the instance's memory, UUID and processes on its handle; clocks and
            the MIG mode only on the parent's.
    """

    mig: dict[int, tuple[FakeGpu | None, ...]] = field(default_factory=dict)

    def _gpu(self, handle: _Handle | _MigHandle) -> FakeGpu:
        if isinstance(handle, _MigHandle):
            instance = self.mig[handle.parent][handle.slot]
            assert instance is not None
            return instance
        return self.gpus[handle.index]

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: _Handle) -> int:  # noqa: N802
        self._enter("nvmlDeviceGetMaxMigDeviceCount")
        if isinstance(handle, _MigHandle) or not self._gpu(handle).mig_mode:
            raise NVMLError_NotSupported()
        return 7  # an A100 or H100 splits into at most seven

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: _Handle, index: int) -> _MigHandle:  # noqa: N802
        self._enter("nvmlDeviceGetMigDeviceHandleByIndex")
        slots = self.mig.get(handle.index, ())
        if not self._gpu(handle).mig_mode or index >= len(slots) or slots[index] is None:
            raise NVMLError_NotFound()
        return _MigHandle(handle.index, index)

    def nvmlDeviceGetMigMode(self, handle: _Handle | _MigHandle) -> list[int]:  # noqa: N802
        if isinstance(handle, _MigHandle):
            self._enter("nvmlDeviceGetMigMode")
            raise NVMLError_InvalidArgument()
        return super().nvmlDeviceGetMigMode(handle)

    def nvmlDeviceGetClockInfo(self, handle: _Handle | _MigHandle, clock_type: int) -> int:  # noqa: N802
        if isinstance(handle, _MigHandle):
            self._enter("nvmlDeviceGetClockInfo")
            raise NVMLError_NotSupported()
        return super().nvmlDeviceGetClockInfo(handle, clock_type)

    def nvmlDeviceGetMaxClockInfo(self, handle: _Handle | _MigHandle, clock_type: int) -> int:  # noqa: N802
        if isinstance(handle, _MigHandle):
            self._enter("nvmlDeviceGetMaxClockInfo")
            raise NVMLError_NotSupported()
        return super().nvmlDeviceGetMaxClockInfo(handle, clock_type)


# Named as Transformer Engine names them: code under test reads them by name from the fake module.
class Format(enum.Enum):
    """``transformer_engine.common.recipe.Format``, the values mpadvise uses."""

    HYBRID = "hybrid"
    E4M3 = "e4m3"


@dataclass
class DelayedScaling:
    """``transformer_engine.common.recipe.DelayedScaling``, the fields mpadvise sets."""

    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    margin: int = 0
