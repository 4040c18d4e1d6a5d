"""The interface every framework adapter implements, what a framework can apply of a Policy
(``FrameworkTraits``, pure: the search space, the trial child, ``mpadvise run`` and ``mpadvise
export`` all read it, so a policy that wins a tune is one its framework can run, and its export
is what the trial applied), and what the adapters share to change a framework in place.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from advisor._log import get_logger
from policies import LossScale, ModeFacts, Policy, create_mode, mode_class, mode_classes, mode_facts
from probes import MpadviseError

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder

TORCH_DTYPE: Mapping[str, str] = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
# Marks a function an adapter has wrapped, so that a second install wraps it no more.
PATCHED = "__mpadvise_patched__"

# The switches a policy sets (TF32) for the rest of the process (the trial is the process).
_HELD_SWITCHES = contextlib.ExitStack()


@dataclass(frozen=True)
class FrameworkTraits:
    """What a framework can apply without a changed line in the script."""

    name: str
    modes: tuple[str, ...]
    sets_micro_batch: bool
    loss_scale_kinds: tuple[str, ...]
    loss_scale_settings: bool
    fp8_recipes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    sets_grad_clip: bool = True
    needs_cuda: tuple[str, ...] = ()

    def refusal(self, policy: Policy, *, device: str | None = None) -> str | None:
        """One line on why this framework cannot apply ``policy``, or ``None`` when it can."""
        framework = self.name
        if policy.mode not in self.modes:
            return f"{framework} cannot apply mode {policy.mode} (it can apply {', '.join(self.modes)})"
        if device is not None and not device.startswith("cuda") and policy.mode in self.needs_cuda:
            return f"{framework} applies {policy.mode} on CUDA only: on {device} it would silently train in fp32"
        split = policy.micro_batch_size is not None or (policy.grad_accum_steps or 1) > 1
        if split and not self.sets_micro_batch:
            return (f"{framework} cannot change the micro-batch: the script's DataLoader sets it "
                    f"(the policy asks for micro-batch {policy.micro_batch_size} x {policy.grad_accum_steps or 1})")
        if policy.grad_clip_norm is not None and not self.sets_grad_clip:
            return f"{framework} leaves gradient clipping to the script: it cannot apply grad_clip_norm {policy.grad_clip_norm:g}"
        ls = policy.loss_scale
        if ls is not None and mode_class(policy.mode).loss_scaling:
            # "none" included: a framework whose fp16 always builds a GradScaler cannot run without one.
            if ls.kind not in self.loss_scale_kinds:
                if ls.kind == "none":
                    return f"{framework} always scales an fp16 loss with a GradScaler, and the policy has no loss scaling"
                return f"{framework} cannot apply a {ls.kind} loss scale (only {', '.join(self.loss_scale_kinds)})"
            default = scaler_kwargs(LossScale())
            changed = [k for k, v in scaler_kwargs(ls).items() if v != default[k]]
            if changed and not self.loss_scale_settings:
                return (f"{framework} cannot set GradScaler's {', '.join(changed)}: it always uses "
                        "GradScaler's defaults (initial scale 65536, growth interval 2000)")
        recipes = self.fp8_recipes.get(policy.mode)
        if recipes is not None:
            recipe = (policy.fp8.recipe if policy.fp8 is not None else None) or recipes[0]
            if recipe not in recipes:
                return f"{framework} cannot build the {policy.mode} recipe {recipe!r} (only {', '.join(recipes)})"
        return None


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

    @classmethod
    def expresses(cls, facts: ModeFacts) -> bool:
        """Whether the framework's own settings can apply a mode with these facts."""
        if facts.fp8_library is not None:
            return facts.fp8_library in cls.fp8 and facts.weights == "fp32" and facts.autocast is None
        if facts.weights != "fp32":
            return facts.weights in cls.half_weights and facts.autocast is None
        return facts.autocast is None or facts.autocast in cls.autocasts

    @classmethod
    def facts_for(cls, policy: Policy) -> ModeFacts:
        """``policy``'s mode facts; an MpadviseError where the framework cannot express the mode."""
        facts = mode_facts(policy.mode)
        if not cls.expresses(facts):
            can = ", ".join(cls.modes())
            raise MpadviseError(f"{cls.label} cannot apply mode {policy.mode}; it can apply {can}")
        return facts

    @classmethod
    def modes(cls) -> tuple[str, ...]:
        """The registered modes it can apply, in registration order (read on every call)."""
        return tuple(mode.name for mode in mode_classes() if cls.expresses(mode.facts()))

    @classmethod
    def traits(cls) -> FrameworkTraits:
        """What the framework can express of a Policy, from the registered modes as they are now."""
        facts = {name: mode_facts(name) for name in cls.modes()}
        return FrameworkTraits(
            cls.name, tuple(facts), sets_micro_batch=cls.sets_micro_batch,
            loss_scale_kinds=cls.loss_scale_kinds, loss_scale_settings=cls.loss_scale_settings,
            sets_grad_clip=cls.sets_grad_clip,
            fp8_recipes={m: cls.fp8[f.fp8_library] for m, f in facts.items() if f.fp8_library is not None},
            needs_cuda=tuple(m for m, f in facts.items() if f.autocast in cls.cuda_only_autocasts),
        )

    @classmethod
    def install(cls, policy: Policy, *, recorder: FrameworkRecorder | None, device: str | None) -> None:
        """Make what the script builds with this framework apply ``policy``, before it runs."""
        raise NotImplementedError(f"{cls.__qualname__} does not say how it applies a policy; define install()")


class Application:
    """What an adapter's ``install()`` decided, applied to what the script builds: the policy, the
    trial's recorder (``None`` under ``mpadvise run``) and device (``None``: the framework's)."""

    def __init__(self, policy: Policy, recorder: FrameworkRecorder | None, device: str | None) -> None:
        self.policy, self.recorder, self.device = policy, recorder, device

    def note(self, text: str | None) -> None:
        """A note in the trial's result; a debug line under ``mpadvise run``."""
        if self.recorder is not None and text is not None:
            self.recorder.note(text)
        elif text is not None:
            get_logger().debug(text)

    def applied(self, device: Any = None) -> None:
        """What the script built runs the candidate (on ``device`` where known): the clock may start."""
        if self.recorder is not None:
            if device is not None:
                self.recorder.set_device(device)
            self.recorder.policy_applied()


def scaler_kwargs(ls: LossScale) -> dict[str, Any]:
    """``GradScaler``'s keyword arguments for a policy's ``[loss_scale]``, its kind aside."""
    return {"init_scale": float(ls.init_scale), "growth_factor": float(ls.growth_factor),
            "backoff_factor": float(ls.backoff_factor), "growth_interval": int(ls.growth_interval)}


def fp16_loss_scale(policy: Policy) -> LossScale:
    """The loss scaling ``policy``'s fp16 autocast runs with: its own, GradScaler's defaults, or none."""
    if not mode_facts(policy.mode).loss_scaling:
        return LossScale(kind="none")
    return policy.loss_scale or LossScale()


def batch_size_of(batch: Any) -> int | None:
    """The leading dimension of the first tensor with one in a batch (a tensor, a sequence, a mapping)."""
    shape = getattr(batch, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    items = (batch.values() if isinstance(batch, Mapping)
             else batch if isinstance(batch, (list, tuple)) else ())
    return next((size for size in map(batch_size_of, items) if size is not None), None)


def wrap_once(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace ``owner.name`` in place by ``make(original)``, unless it is wrapped already."""
    original = getattr(owner, name)
    if getattr(original, PATCHED, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, PATCHED, True)
    setattr(owner, name, wrapped)


def around(before: Callable[..., Any], after: Callable[[Any], None] | None = None) -> Callable[..., Any]:
    """For ``wrap_once``: a method calling ``before(obj, *args)``, the original, ``after(obj)``."""

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            before(self, *args, **kwargs)
            result = original(self, *args, **kwargs)
            if after is not None:
                after(self)
            return result

        return method

    return make


def hold_switches(policy: Policy, device: Any = None) -> str | None:
    """Set ``policy``'s TF32 switches on ``device`` (``None``: CUDA where there is one) for the
    rest of the process, as the loop API's modes do; the note saying so, ``None`` if it sets none."""
    tf32 = mode_facts(policy.mode).tf32
    if tf32 is None:
        return None
    import torch

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    _HELD_SWITCHES.enter_context(create_mode(policy, device).process_switches())
    cudnn = " and cuDNN" if device.type == "cuda" else ""
    return f"TF32 {'on' if tf32 else 'off'} for matmuls{cudnn}, as {policy.mode} sets it"


def shift_seed(owners: Sequence[Any], name: str, recorder: FrameworkRecorder, *,
               move: Callable[[int], int] | None = None, default: Callable[[], Any] | None = None) -> None:
    """Make the script's ``name(seed)``, held by each of ``owners``, seed ``move(seed)`` (the trial's
    seed added) for an integer seed, with a note, and ``default()`` for ``None`` where given."""
    shift = recorder.spec.seed

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def seeded(seed: Any = None, *args: Any, **kwargs: Any) -> Any:
            if isinstance(seed, numbers.Integral) and not isinstance(seed, bool):  # numpy's too
                moved = move(int(seed)) if move is not None else int(seed) + shift
                if moved != seed:
                    recorder.note(f"the script's {name}({seed}) ran as {name}({moved}) (trial seed {shift})")
                seed = moved
            elif seed is None and default is not None:
                seed = default()
            return original(seed, *args, **kwargs)

        return seeded

    for owner in owners if shift else ():
        wrap_once(owner, name, make)


class StepLosses:
    """The losses and samples of the micro-batches of the optimizer step in progress."""

    def __init__(self) -> None:
        self.reset()

    def add(self, loss: Any, samples: int | None = 0) -> None:
        if loss is not None:
            self.losses.append(loss.detach().float().clone() if hasattr(loss, "detach") else float(loss))
        self.samples += samples or 0
        self.micro_batches += 1

    def total(self, *, mean: bool) -> Any:
        """The losses' mean or sum; NaN without one (a step with no loss to read is not finite)."""
        losses = self.losses
        if not losses:
            return float("nan")
        total = sum(losses[1:], losses[0])
        return total / len(losses) if mean else total

    def record(self, recorder: FrameworkRecorder, scale: float | None, skipped: bool, *,
               mean: bool = True) -> None:
        """End the optimizer step: record its loss, scale and skip; the next step starts empty."""
        recorder.step(loss=self.total(mean=mean), loss_scale=scale, skipped=skipped,
                      samples=self.samples or None)
        self.reset()

    def reset(self) -> None:
        self.losses: list[Any] = []
        self.samples = 0
        self.micro_batches = 0
