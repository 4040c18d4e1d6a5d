"""Which frameworks and export targets exist: one ordered registry of adapter classes, which every
list of frameworks reads. Adding a framework is its adapter class and one ``register_framework``
line; adding an export target is one ``_export_<target>.py`` module and one line here.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from policies import Policy
from probes import MpadviseError, UsageError

from ._accelerate import AccelerateAdapter
from ._adapter import FrameworkAdapter, FrameworkTraits
from ._export import Export, Exporter
from ._export_accelerate import AccelerateExporter
from ._export_deepspeed import DeepSpeedExporter
from ._export_lightning import FabricExporter, LightningExporter
from ._export_torchtitan import TorchtitanExporter
from ._export_transformers import TransformersExporter
from ._lightning import LightningFabric, LightningTrainer
from ._torch import PlainTorch
from ._torch_export import TorchExporter
from ._transformers import HuggingFaceTrainer

AdapterT = TypeVar("AdapterT", bound=type[FrameworkAdapter])

# The registered adapter classes by name, in registration order (the order of FRAMEWORKS).
_FRAMEWORKS: dict[str, type[FrameworkAdapter]] = {}
# Export targets by name: each framework's exporter, and the export-only targets.
_EXPORTERS: dict[str, type[Exporter]] = {}


def register_framework(cls: AdapterT, *, exporter: type[Exporter] | None = None) -> AdapterT:
    """Add a ``FrameworkAdapter`` subclass, with the ``Exporter`` of its settings, if any."""
    if not (isinstance(cls, type) and issubclass(cls, FrameworkAdapter)):
        raise TypeError(f"register_framework: {cls!r} is not a FrameworkAdapter subclass; derive the "
                        "framework's class from advisor.frameworks.FrameworkAdapter")
    owner = f"register_framework({cls.__qualname__})"
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name or name != name.lower():
        raise ValueError(f"{owner}: name {name!r} is not allowed; set a lowercase name, e.g. 'composer'")
    if _FRAMEWORKS.get(name) is cls:
        return cls
    if name in _FRAMEWORKS or name in _EXPORTERS:
        raise ValueError(f"{owner}: framework {name!r} is already registered; give the class a name of its own")
    if cls.install.__func__ is FrameworkAdapter.install.__func__:  # type: ignore[attr-defined]
        raise ValueError(f"{owner}: the class does not say how it applies a policy; define install()")
    if exporter is not None:
        if getattr(exporter, "target", None) != name:
            raise ValueError(f"{owner}: exporter {exporter.__qualname__} writes for "
                             f"{getattr(exporter, 'target', None)!r}, not {name!r}; set its target to {name!r}")
        _EXPORTERS[name] = exporter
    _FRAMEWORKS[name] = cls
    return cls


def register_export_target(exporter: type[Exporter]) -> type[Exporter]:
    """Add an export-only target (``mpadvise export --to`` only; no scripts are tuned through it)."""
    target = exporter.target
    if _EXPORTERS.get(target) is exporter:
        return exporter
    if target in _EXPORTERS or target in _FRAMEWORKS:
        raise ValueError(f"register_export_target({exporter.__qualname__}): export target {target!r} "
                         "is already registered")
    _EXPORTERS[target] = exporter
    return exporter


def framework_classes() -> tuple[type[FrameworkAdapter], ...]:
    return tuple(_FRAMEWORKS.values())


def framework_names() -> tuple[str, ...]:
    return tuple(_FRAMEWORKS)


def detection_order() -> tuple[type[FrameworkAdapter], ...]:
    """The registered adapter classes by detection precedence (the loop's owner first)."""
    return tuple(sorted(_FRAMEWORKS.values(), key=lambda cls: cls.precedence))


def check_framework(name: str) -> str:
    """The framework ``name`` names, in any case; else a UsageError naming the closest."""
    return choose(name, _FRAMEWORKS, what="framework")


def choose(name: str, choices: Iterable[str], *, what: str) -> str:
    """The one of ``choices`` a user means by ``name``, in any case; else a UsageError."""
    names = tuple(choices)
    text = str(name).strip()
    by_lower = {choice.lower(): choice for choice in names}
    if text.lower() in by_lower:
        return by_lower[text.lower()]
    close = [by_lower[c] for c in difflib.get_close_matches(text.lower(), list(by_lower), n=3, cutoff=0.6)]
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    raise UsageError(f"unknown {what} {text!r}; {hint}expected one of {', '.join(names)}")


def framework_class(name: str) -> type[FrameworkAdapter]:
    return _FRAMEWORKS[check_framework(name)]


def traits(framework: str) -> FrameworkTraits:
    return framework_class(framework).traits()


def refusal(policy: Policy, framework: str, *, device: str | None = None) -> str | None:
    """Why ``framework`` cannot apply ``policy`` as it stands, or ``None``."""
    return traits(framework).refusal(policy, device=device)


def check_expressible(policy: Policy, framework: str, *, source: str = "the policy",
                      device: str | None = None) -> Policy:
    """``policy`` if ``framework`` can apply it; else an MpadviseError naming ``source``."""
    reason = refusal(policy, framework, device=device)
    if reason is not None:
        raise MpadviseError(f"{source}: {reason}")
    return policy


def export_targets() -> tuple[str, ...]:
    """The frameworks with an exporter, in registration order, then the export-only targets."""
    frameworks = [name for name in _FRAMEWORKS if name in _EXPORTERS]
    return (*frameworks, *(name for name in _EXPORTERS if name not in _FRAMEWORKS))


def check_target(name: str | None) -> str:
    """The export target ``name`` names, in any case; else a UsageError."""
    if name is None:
        raise UsageError(f"missing --to TARGET; expected one of {', '.join(export_targets())}")
    return choose(name, export_targets(), what="export target")


def export_policy(policy: Policy, target: str, *, device: str = "cuda", source: str | None = None,
                  script: Path | None = None) -> Export:
    """``policy`` as ``target``'s own settings, judged by its framework's traits (if it has one)."""
    target = check_target(target)
    framework = _FRAMEWORKS.get(target)
    exporter = _EXPORTERS[target]()
    exporter.script = script
    return exporter.export(policy, traits=None if framework is None else framework.traits(), device=device, source=source)


for _cls, _exporter in ((LightningTrainer, LightningExporter), (LightningFabric, FabricExporter),
                        (HuggingFaceTrainer, TransformersExporter), (AccelerateAdapter, AccelerateExporter),
                        (PlainTorch, TorchExporter)):
    register_framework(_cls, exporter=_exporter)
for _exporter in (DeepSpeedExporter, TorchtitanExporter):
    register_export_target(_exporter)
