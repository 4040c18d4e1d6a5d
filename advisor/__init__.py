"""mpadvise: measure, pick and apply the fastest stable precision policy for PyTorch training.

A training script needs ``load_policy()`` and the object it returns (README, "The Python API").
Every name here loads on first use (PEP 562), so ``import advisor`` costs next to nothing."""

from __future__ import annotations

import sys as _sys
from types import ModuleType as _ModuleType
from typing import TYPE_CHECKING

from advisor._lazy import lazy_surface
from advisor._version import __version__

if TYPE_CHECKING:  # what static tools see; at run time each name loads on first use
    from advisor._load import load_policy
    from advisor.runtime import AppliedPolicy
    from advisor.tune import tune
    from policies import MODES, Fp8Options, LossScale, Policy, PolicyError
    from probes import MpadviseError

_EXPORTS = {
    "load_policy": "_load",
    "AppliedPolicy": "advisor.runtime",
    "tune": "advisor.tune",
    "MODES": "policies",
    "Fp8Options": "policies",
    "LossScale": "policies",
    "Policy": "policies",
    "PolicyError": "policies",
    "MpadviseError": "probes",
}

__all__ = ["MODES", "AppliedPolicy", "Fp8Options", "LossScale", "MpadviseError", "Policy",
           "PolicyError", "__version__", "load_policy", "tune"]


class _Surface(_ModuleType):
    """``advisor`` itself: importing the subpackage ``advisor.tune`` sets the package's attribute
    to it, so the attribute keeps its function ``tune`` instead (the API is ``advisor.tune(...)``)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name == "tune" and isinstance(value, _ModuleType) and value.__name__ == f"{self.__name__}.tune":
            value = getattr(value, "tune", value)
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Surface
__getattr__, __dir__ = lazy_surface(__name__, _EXPORTS, globals())
