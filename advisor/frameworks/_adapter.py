"""The one small interface every framework adapter implements: what the framework is, how a
script using it is recognised, what it can express of a Policy, and how a policy is applied.

An adapter describes itself in class attributes (name, label, the imports that detect it, its
detection precedence, what it sets) and classmethods (``expresses``, ``traits``, ``install``).
The registry (``_registry``), detection, the search space of a framework script, the trial
child and ``mpadvise export`` all read them, so adding a framework means writing one class and
registering it.

Adapters translate a mode's facts (``policies.ModeFacts``: autocast dtype, weight dtype, TF32,
loss scaling, FP8 library), never its name. So the modes a framework can apply are derived,
on every lookup, from the registered modes whose facts it can express: a mode registered later
is applied and searched through every framework that can express it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar

from policies import ModeFacts, Policy, mode_classes

from ._traits import FrameworkTraits

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder


class FrameworkAdapter:
    """Base class of the framework adapters; a subclass declares what its framework is and does.

    What a registered adapter class sets:
        name: the framework's name on the command line and in trial specs (``"lightning"``).
        label: the framework for people (``"Lightning's Trainer"``).
        detected_by: module -> the names imported from it (or read as its attributes) that
            mean a script trains with this framework: ``{"lightning.pytorch": ("Trainer",)}``.
        precedence: which framework runs the loop when a script uses several; lower wins (a
            Trainer before the Fabric or Accelerator it is built on).
        autocasts: the autocast dtype families it applies over fp32 weights (``"bf16"``...).
        half_weights: the pure half weight dtypes it applies (``"bf16"``, ``"fp16"``).
        fp8: FP8 library -> the recipes it can build with it.
        cuda_only_autocasts: autocast families it applies on CUDA only (on a CPU it would
            silently train in fp32).
        sets_micro_batch, loss_scale_kinds, loss_scale_settings, sets_grad_clip, limits: as
            ``FrameworkTraits`` has them.
        ``install(policy, *, recorder, device)``: patch the framework in the script's process.
    """

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
        """Whether the framework's own settings can apply a mode with these facts.

        The base reads the declared attributes: an FP8 library it builds recipes for (over fp32
        weights), a pure half weight dtype it has (no autocast), or fp32 weights with no autocast
        or one of its autocasts. TF32 on or off every framework applies (a process switch).
        """
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
        """Make what the script builds with this framework apply ``policy``, before the script runs.

        Args:
            policy: the policy to apply (one the traits accept).
            recorder: the trial recorder, or ``None`` under ``mpadvise run``.
            device: the trial's device (``"cpu"``, ``"cuda:1"``), or ``None`` for the script's own.
        """
        raise NotImplementedError(f"{cls.__qualname__} does not say how it applies a policy; define install()")
