"""HardwareProfile: plain, hashable facts about one device, as gathered by the probes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass(frozen=True)
class HardwareProfile:
    """What one device (a CUDA GPU or the host CPU) can do, as hashable data that round-trips
    through JSON; fields of the other kind keep their defaults. ``cuda_runtime`` is the CUDA torch
    was built with; ``libraries`` the FP8 libraries' versions (``None``: not installed);
    ``cuda_arch_list`` what the torch build has kernels for (``()``: not recorded)."""

    kind: str
    name: str
    index: int | None = None
    compute_capability: tuple[int, int] | None = None
    sm_count: int | None = None
    memory_total: int | None = None
    memory_free: int | None = None
    driver_version: str | None = None
    cuda_runtime: str | None = None
    mig_enabled: bool | None = None
    clocks_mhz: tuple[int, int] | None = None
    cores: int | None = None
    cpu_flags: tuple[str, ...] = ()
    torch_version: str | None = None
    libraries: tuple[tuple[str, str | None], ...] = ()
    uuid: str | None = None
    cuda_arch_list: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("cuda", "cpu"):
            raise ValueError(f"HardwareProfile.kind must be 'cuda' or 'cpu', got {self.kind!r}")

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def device(self) -> str:
        return f"cuda:{self.index or 0}" if self.is_cuda else "cpu"

    def has_flag(self, flag: str) -> bool:
        return flag in self.cpu_flags

    def library_version(self, name: str) -> str | None:
        return dict(self.libraries).get(name)

    def to_dict(self) -> dict[str, Any]:
        # JSON-ready: tuples become lists, the libraries a table.
        data = {key: list(value) if isinstance(value, tuple) else value for key, value in asdict(self).items()}
        data["libraries"] = dict(self.libraries)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareProfile:
        """Inverse of ``to_dict``; unknown keys are ignored, so newer files still load."""
        kwargs = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        kwargs = {key: tuple(v) if isinstance(v, list) else v for key, v in kwargs.items()}
        for key in ("cpu_flags", "cuda_arch_list"):
            kwargs[key] = tuple(kwargs.get(key) or ())
        libs = kwargs.get("libraries") or {}
        pairs = libs.items() if isinstance(libs, dict) else libs
        kwargs["libraries"] = tuple(sorted((str(k), v) for k, v in pairs))
        return cls(**kwargs)
