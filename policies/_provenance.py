"""Where a tuned policy was measured, and what differs here: structured differences, formatted
only where a person reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from probes import hardware_fingerprint

if TYPE_CHECKING:
    from probes import HardwareProfile

    from ._config import Policy


@dataclass(frozen=True)
class Difference:
    """One fact that changed between the tune and this machine.

    Attributes:
        what: ``"device"``, ``"torch"`` or an FP8 library name.
        tuned: its value when the policy was tuned; ``None`` for absent.
        here: its value on this machine; ``None`` for absent.
    """

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
    """Why a tuned policy must not be applied on this hardware.

    Attributes:
        differences: the named facts that changed; empty when only facts outside them
            (driver, CUDA, memory, capability details) differ.
        tuned_fingerprint: the hardware fingerprint the policy was tuned on.
    """

    differences: tuple[Difference, ...]
    tuned_fingerprint: str

    def detail(self) -> str:
        """``"torch 2.5.1 -> 2.6.0; torchao absent -> 0.10.0"``."""
        return "; ".join(d.describe() for d in self.differences) or "driver, CUDA or hardware details differ"

    def describe(self) -> str:
        """``"tuned on other hardware or versions (torch 2.5.1 -> 2.6.0)"``."""
        return f"tuned on other hardware or versions ({self.detail()})"

    def reason(self) -> str:
        """The sentence a log line continues with: ``"it was tuned on ..."``."""
        return f"it was {self.describe()}"

    def to_dict(self) -> dict[str, object]:
        return {
            "tuned_fingerprint": self.tuned_fingerprint,
            "differences": [d.to_dict() for d in self.differences],
        }


def hardware_mismatch(policy: Policy, profile: HardwareProfile) -> HardwareMismatch | None:
    """What differs between where ``policy`` was tuned and ``profile``; ``None`` when it may apply.

    A policy without a ``[tuned_on]`` record was written by hand and applies anywhere it is
    supported.
    """
    tuned = policy.tuned_on
    if tuned is None or not tuned.hardware_fingerprint:
        return None
    if tuned.hardware_fingerprint == hardware_fingerprint(profile):
        return None
    differences = []
    if tuned.device and tuned.device != profile.name:
        differences.append(Difference("device", tuned.device, profile.name))
    if tuned.torch and tuned.torch != profile.torch_version:
        differences.append(Difference("torch", tuned.torch, profile.torch_version))
    now_libs = dict(profile.libraries)
    for name, version in tuned.libraries:
        if now_libs.get(name) != version:
            differences.append(Difference(name, version, now_libs.get(name)))
    return HardwareMismatch(tuple(differences), tuned.hardware_fingerprint)
