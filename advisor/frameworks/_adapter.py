"""The interface every framework adapter implements: what the framework is, how a script using
it is recognised, what it can express of a Policy, and how a policy is applied.

Adapters translate a mode's facts (``policies.ModeFacts``), never its name, so a mode
registered later is applied and searched through every framework that can express it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from policies import ModeFacts, Policy, mode_classes

from ._traits import FrameworkTraits

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder


class FrameworkAdapter:
    """Base class of the framework adapters. ``detected_by``: module -> the names that mean the
    framework; ``precedence``: lower wins when a script uses several (a Trainer before the
    Accelerator it is built on); ``autocasts``, ``half_weights``, ``fp8`` (library -> recipes):
    the modes it can express. The rest are as ``FrameworkTraits`` has them."""

    name: ClassVar[str]
    label: ClassVar[str]
    detected_by: ClassVar[Mapping[str, tuple[str, ...]]]
    precedence: ClassVar[int]
    autocasts: ClassVar[tuple[str, ...]] = ()
    half_weights: ClassVar[tuple[str, ...]] = ()
    fp8: ClassVar[Mapping[str, tuple[str, ...]]] = {}
    cuda_only_autocasts: ClassVar[tuple[str, ...]] = ()
    sets_micro_batch: ClassVar[bool] = False
    loss_scale_kinds: ClassVar[tuple[str, ...]] = ("dynamic",)
    loss_scale_settings: ClassVar[bool] = False
    sets_grad_clip: ClassVar[bool] = True
    limits: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def expresses(cls, facts: ModeFacts) -> bool:
        """Whether the framework's own settings can apply a mode with these facts."""
        if facts.fp8_library is not None:
            return facts.fp8_library in cls.fp8 and facts.weights == "fp32" and facts.autocast is None
        if facts.weights != "fp32":
            return facts.weights in cls.half_weights and facts.autocast is None
        return facts.autocast is None or facts.autocast in cls.autocasts

    @classmethod
    def modes(cls) -> tuple[str, ...]:
        """The registered modes it can apply, in registration order (read on every call)."""
        return tuple(mode.name for mode in mode_classes() if cls.expresses(mode.facts()))

    @classmethod
    def traits(cls) -> FrameworkTraits:
        """What the framework can express of a Policy, from the registered modes as they are now."""
        modes = [mode for mode in mode_classes() if cls.expresses(mode.facts())]
        fp8_recipes = {mode.name: cls.fp8[mode.facts().fp8_library] for mode in modes
                       if mode.facts().fp8_library is not None}
        needs_cuda = tuple(mode.name for mode in modes if mode.facts().autocast in cls.cuda_only_autocasts)
        return FrameworkTraits(
            cls.name, tuple(mode.name for mode in modes), sets_micro_batch=cls.sets_micro_batch,
            loss_scale_kinds=cls.loss_scale_kinds, loss_scale_settings=cls.loss_scale_settings,
            fp8_recipes=fp8_recipes, sets_grad_clip=cls.sets_grad_clip, needs_cuda=needs_cuda, limits=cls.limits,
        )

    @classmethod
    def install(cls, policy: Policy, *, recorder: FrameworkRecorder | None, device: str | None) -> None:
        """Make what the script builds with this framework apply ``policy``, before it runs."""
        raise NotImplementedError(f"{cls.__qualname__} does not say how it applies a policy; define install()")
