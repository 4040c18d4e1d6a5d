"""Where a tuned policy was measured, and what differs here: structured differences, formatted
only where a person reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from probes import hardware_fingerprint, major_minor

from ._fp8 import Fp8Mode
from ._registry import mode_class

if TYPE_CHECKING:
    from probes import HardwareProfile

    from ._config import Policy


@dataclass(frozen=True)
class Difference:
    """One fact (``"device"``, ``"torch"``, ``"CUDA"``, an FP8 library) that changed between
    the tune and this machine; ``None`` for absent."""

    what: str
    tuned: str | None
    here: str | None

    def describe(self) -> str:
        """``"torch 2.5.1 -> 2.6.0"``."""
        return f"{self.what} {self.tuned or 'absent'} -> {self.here or 'absent'}"

    def to_dict(self) -> dict[str, str | None]:
        return {"what": self.what, "tuned": self.tuned, "here": self.here}


@dataclass(frozen=True)
class HardwareMismatch:
    """Why a tuned policy must not be applied on this hardware; ``differences`` is empty when
    only facts outside them (compute capability, memory, SM count) differ."""

    differences: tuple[Difference, ...]
    tuned_fingerprint: str

    def detail(self) -> str:
        """``"torch 2.5.1 -> 2.6.0; torchao absent -> 0.10.0"``."""
        return "; ".join(d.describe() for d in self.differences) or "compute capability, memory or other hardware details differ"

    def describe(self) -> str:
        """``"tuned on other hardware or versions (torch 2.5.1 -> 2.6.0)"``."""
        return f"tuned on other hardware or versions ({self.detail()})"

    def reason(self) -> str:
        """The sentence a log line continues with: ``"it was tuned on ..."``."""
        return f"it was {self.describe()}"


def hardware_mismatch(policy: Policy, profile: HardwareProfile) -> HardwareMismatch | None:
    """What differs between where ``policy`` was tuned and ``profile``; ``None`` when it may apply.

    The hardware fingerprint decides, so a driver upgrade or a patch release keeps a tuned
    policy; an FP8 policy also needs its FP8 library at the same version (its kernels change
    between releases). A policy without ``[tuned_on]`` was written by hand and applies anywhere.
    """
    tuned = policy.tuned_on
    if tuned is None or not tuned.hardware_fingerprint:
        return None
    library = _fp8_library_change(policy, profile)
    # Recipe 1 too: a policy recorded before recipe 2 on this very machine still applies.
    if tuned.hardware_fingerprint in (hardware_fingerprint(profile), hardware_fingerprint(profile, version=1)):
        return None if library is None else HardwareMismatch((library,), tuned.hardware_fingerprint)
    differences = []
    if tuned.device and tuned.device != profile.name:
        differences.append(Difference("device", tuned.device, profile.name))
    for what, tuned_version, here_version in (
        ("torch", tuned.torch, profile.torch_version),
        ("CUDA", tuned.cuda, profile.cuda_runtime),
    ):
        # Only a new release line changes the fingerprint; a patch release is not named as a cause.
        if tuned_version and major_minor(tuned_version) != major_minor(here_version):
            differences.append(Difference(what, tuned_version, here_version))
    if library is not None:
        differences.append(library)
    return HardwareMismatch(tuple(differences), tuned.hardware_fingerprint)


def _fp8_library_change(policy: Policy, profile: HardwareProfile) -> Difference | None:
    cls = mode_class(policy.mode)
    if not issubclass(cls, Fp8Mode) or policy.tuned_on is None:
        return None
    tuned, here = dict(policy.tuned_on.libraries).get(cls.library), profile.library_version(cls.library)
    return None if tuned == here else Difference(cls.library, tuned, here)
