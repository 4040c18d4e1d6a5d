"""The plain-PyTorch adapter's hooks at torch's own seams: the model's forward, ``Tensor.backward``,
the optimizer's construction and step, ``GradScaler`` and gradient clipping.

Seams as torch (2.13) runs them: the global forward pre-hooks and forward hooks
(``always_call=True``: also after a forward that raised) for every module's ``__call__``; the
global optimizer step hooks around every ``Optimizer.step`` (none for a step GradScaler skipped);
every optimizer's ``__init__`` calls ``Optimizer.__init__``.
"""

from __future__ import annotations

import functools
import math
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from advisor.frameworks._adapter import TORCH_DTYPE, StepLosses, fp16_loss_scale, scaler_kwargs
from policies import Policy, create_mode, mode_facts

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder


@dataclass
class Sightings:
    """What the script did so far at torch's seams, for the line that says so."""

    models: list[str] = field(default_factory=list)
    forwards: int = 0
    backwards: int = 0
    optimizer_steps: int = 0
    optimizers: int = 0
    scalers: int = 0

    def model(self, name: str) -> None:
        if name not in self.models and len(self.models) < 3:
            self.models.append(name)


def seen_line(seen: Sightings, *, what: str) -> str:
    """One line: ``what`` happened, and how far the script got (pure)."""
    forward = (f"{seen.forwards} forward{'s' if seen.forwards != 1 else ''} of {', '.join(seen.models)}"
               if seen.forwards else "no forward of a module")
    backward = f"{seen.backwards} backward{'s' if seen.backwards != 1 else ''}" if seen.backwards else "no backward"
    step = (f"{seen.optimizer_steps} optimizer step{'s' if seen.optimizer_steps != 1 else ''}" if seen.optimizer_steps
            else "no optimizer step" + ("" if seen.optimizers else " (no torch.optim optimizer built)"))
    return f"{what}: it ran {forward}, {backward}, {step}"


class ForwardPrecision:
    """The candidate's precision around the outermost module forward (one per process): its
    autocast, or autocast off over the script's own; in the pure modes the model and floating
    inputs in half, floating outputs back to fp32 (as Lightning Fabric's half precision does, so a
    loss computed outside the model meets fp32 targets)."""

    def __init__(self, policy: Policy, steps: Steps) -> None:
        import torch

        self.policy = policy
        self.facts = mode_facts(policy.mode)
        self.steps = steps
        self.half = None if self.facts.weights == "fp32" else getattr(torch, TORCH_DTYPE[self.facts.weights])
        self._local = threading.local()
        self._modes: dict[str, Any] = {}
        self._cast: weakref.WeakSet[Any] = weakref.WeakSet()
        self._converted: weakref.WeakSet[Any] = weakref.WeakSet()
        self._checked = False

    def mode_for(self, device_type: str) -> Any:
        import torch

        if device_type not in self._modes:
            # The mode's own GradScaler (fp16-mixed builds one) is none of the script's.
            self.steps.counting_scalers = False
            try:
                self._modes[device_type] = create_mode(self.policy, torch.device(device_type))
            finally:
                self.steps.counting_scalers = True
        return self._modes[device_type]

    def cast_parameters(self, params: list[Any]) -> None:
        """Pure modes: the floating parameters in half, in place, before an optimizer holds them."""
        if self.half is None:
            return
        for p in params:
            if p.is_floating_point() and p.dtype != self.half:
                p.data = p.data.to(self.half)

    def cast_module(self, module: Any) -> None:
        """Pure modes: the module's floating parameters and buffers in half, once."""
        if self.half is not None and module not in self._cast:
            self._cast.add(module)
            module.to(dtype=self.half)  # Module.to keeps each Parameter, so an optimizer still holds it

    def convert_module(self, module: Any, device_type: str) -> None:
        """FP8 modes: swap the model's eligible Linear layers in place, once, at its first training forward."""
        import torch

        if (self.facts.fp8_library is None or module in self._converted or not torch.is_grad_enabled()
                or isinstance(module, torch.nn.Linear) or not any(True for _ in module.parameters())):
            return
        self._converted.add(module)
        mode = self.mode_for(device_type)
        mode.convert_module(module)
        for note in mode.notes:
            self.steps.note(note)

    def pre(self, module: Any, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        import torch

        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        if depth:
            if depth == 1 and not self._checked and torch.is_grad_enabled():
                self._checked = True
                self.steps.note(autocast_note(_device_type(module, args)))
            return None
        device_type = _device_type(module, args)
        self.convert_module(module, device_type)
        if self.half is not None:
            self.cast_module(module)
            args = _cast_floats(args, self.half)
        script_autocast = torch.is_autocast_enabled(device_type)
        context: Any = None
        if self.facts.autocast is not None:
            context = self.mode_for(device_type).forward_context()
        elif script_autocast:  # a mode without autocast overrules the script's; none is on otherwise
            context = torch.autocast(device_type=device_type, enabled=False)
        if context is not None:
            context.__enter__()
        self._local.__dict__.setdefault("contexts", []).append(context)
        self.steps.forward(module, args, device_type=device_type, script_autocast=script_autocast)
        return args if self.half is not None else None

    def post(self, module: Any, args: tuple[Any, ...], result: Any) -> Any:
        import torch

        depth = getattr(self._local, "depth", 1) - 1
        self._local.depth = depth
        if depth:
            return None
        stack = getattr(self._local, "contexts", None)
        context = stack.pop() if stack else None
        if context is not None:
            context.__exit__(None, None, None)
        if self.half is not None and result is not None:
            return _cast_floats(result, torch.float32, only=self.half)
        return None


def _device_type(module: Any, args: Any) -> str:
    for p in module.parameters():
        return p.device.type
    tensor = _first_tensor(args)
    return "cpu" if tensor is None else tensor.device.type


def _first_tensor(values: Any) -> Any:
    if hasattr(values, "dim") and hasattr(values, "device"):
        return values
    items = values.values() if isinstance(values, dict) else values if isinstance(values, (list, tuple)) else ()
    return next((found for found in map(_first_tensor, items) if found is not None), None)


def _cast_floats(values: Any, dtype: Any, *, only: Any = None) -> Any:
    if hasattr(values, "is_floating_point") and hasattr(values, "to"):
        if values.is_floating_point() and values.dtype != dtype and (only is None or values.dtype == only):
            return values.to(dtype)
        return values
    if isinstance(values, tuple) and not hasattr(values, "_fields"):
        return tuple(_cast_floats(v, dtype, only=only) for v in values)
    if isinstance(values, list):
        return [_cast_floats(v, dtype, only=only) for v in values]
    if isinstance(values, dict):
        return {k: _cast_floats(v, dtype, only=only) for k, v in values.items()}
    return values


def autocast_note(device_type: str) -> str:
    """Which autocast, if any, reached the first training forward's inner modules."""
    import torch

    if not torch.is_autocast_enabled(device_type):
        return "the first training forward ran without autocast"
    dtype = str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    return f"the first training forward ran under {device_type} autocast to {dtype}"


class Steps:
    """Step boundaries and the loss of each step, fed to the trial recorder (``None`` in a run).

    A step ends at the lead optimizer's step (the first one that steps), at a ``GradScaler``'s
    ``step`` that skipped it, or, with no optimizer, at the first training forward after a
    backward once the parameters or their gradients changed (an update by hand). The step's loss
    is the sum of its backwards' (the script divides each by its accumulation count).
    """

    def __init__(self, recorder: FrameworkRecorder | None, *, refuse: Callable[[str], None], label: str) -> None:
        self.recorder = recorder
        self.refuse = refuse
        self.label = label
        self.seen = Sightings()
        self.optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self.scaling: Any = None  # the injected GradScaler (fp16-mixed where the script built none)
        self.scaling_wanted = False
        self.counting_scalers = True
        self.lead: Any = None
        self.step = StepLosses()
        self._scaled: tuple[Any, Any] | None = None
        self.pending_step: tuple[float | None, bool] | None = None
        self._in_scaler = False
        self._model: Any = None
        self._signature: list[int] | None = None

    def note(self, text: str) -> None:
        if self.recorder is not None:
            self.recorder.note(text)

    def forward(self, module: Any, args: Any, *, device_type: str, script_autocast: bool) -> None:
        import torch

        self.seen.forwards += 1
        self.seen.model(type(module).__name__)
        if script_autocast:  # a note once: the recorder keeps each note once
            self.note(f"the script's own {device_type} autocast gives way to {self.label}'s inside the model's forward")
        if not torch.is_grad_enabled():
            return  # evaluation: start-up, not a training step
        if self._model is None and any(True for _ in module.parameters()):
            self._model = module
            if self.recorder is not None:
                self.recorder.perturb(module)
                self.recorder.watch_model(module)
        if self._signature is not None and module is self._model and not self.optimizers:
            if _signature(module) != self._signature:
                self._signature = None
                self._end(None, False)  # updated by hand since the last backward
        tensor = _first_tensor(args)
        if tensor is not None and tensor.dim() > 0:
            self.step.samples += int(tensor.shape[0])

    def scaled(self, scaled: Any, loss: Any) -> Any:
        """A GradScaler scaled ``loss``: its backward records ``loss`` itself."""
        if hasattr(loss, "device"):
            self._scaled = (scaled, loss)
        return scaled

    def backward(self, tensor: Any) -> Any:
        """A backward's tensor is a loss: record it (unscaled) and return what to run backward from."""
        loss = tensor
        if self._scaled is not None and self._scaled[0] is tensor:
            loss = self._scaled[1]
        self._scaled = None
        self.seen.backwards += 1
        if self.seen.backwards == 1:
            self._first_backward()
        self.step.add(loss)
        return self.scaling.scale(tensor) if self.scaling is not None and loss is tensor else tensor

    def after_backward(self) -> None:
        if not self.optimizers and self._model is not None:
            self._signature = _signature(self._model)

    def _first_backward(self) -> None:
        if self.scaling_wanted and not self.seen.scalers:
            if not self.seen.optimizers:
                self.refuse("fp16-mixed is not expressible for this script: it updates its parameters by hand, with "
                            "no torch.optim optimizer, so no GradScaler can unscale its gradients and skip an "
                            "overflowing step (the other modes apply)")
            self.scaling = self.make_scaler()
            self.note("the script builds no GradScaler: fp16-mixed's loss scaling is injected around its backward "
                      "and optimizer step")
        if self.recorder is not None and not self.recorder.begun:
            self.recorder.begin(user_batch=None, micro_batch=self.step.samples or None, grad_accum_steps=None)

    make_scaler: Callable[[], Any] = staticmethod(lambda: None)
    # Under `mpadvise run` with the guard on: each optimizer step's loss (its micro-batches'
    # sum), the scale it ended with (None where none, or not finite) and whether it was skipped.
    watch: Callable[[Any, float | None, bool], None] | None = None

    def optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.seen.optimizer_steps += 1
        if self.lead is None:
            self.lead = optimizer
        if self.pending_step is not None and self.scaling is not None:
            scale, skipped = self.pending_step
            self.scaling.update()
            self.pending_step = None
            self._end(scale, skipped)
        elif optimizer is self.lead and not self._in_scaler:
            self._end(None, False)

    def scaler_step(self, scaler: Any, optimizer: Any, step: Callable[[], Any]) -> Any:
        """A script's ``scaler.step(optimizer)`` (``step``): the optimizer step ends there, with the
        scale and whether the scaler skipped it (the found-inf value ``step`` reads anyway). A trial
        records every step's scale; a run's guard needs it only where it fell, sparing the others
        a device sync."""
        scale, skipped = None, False
        if scaler._enabled and scaler._scale is not None:
            state = scaler._per_optimizer_states[id(optimizer)]
            if state["stage"].name == "READY":
                scaler.unscale_(optimizer)
            found = sum(v.item() for v in state["found_inf_per_device"].values())
            scale, skipped = scaler.get_scale() if found or self.recorder is not None else None, found > 0
        self._in_scaler = True
        try:
            result = step()
        finally:
            self._in_scaler = False
        if self.lead is None:
            self.lead = optimizer
        if optimizer is self.lead:
            self._end(scale, skipped)
        return result

    def _end(self, scale: float | None, skipped: bool) -> None:
        losses, samples, loss = self.step.losses, self.step.samples, self.step.total(mean=False)
        self.step.reset()
        recording = self.recorder is not None and self.recorder.begun
        if not losses or not (recording or self.watch is not None):
            return
        finite_scale = None if scale is None or not math.isfinite(scale) else scale
        if self.watch is not None:
            self.watch(loss, finite_scale, skipped)
        if not recording:
            return
        if self.recorder.workload_fingerprint is None and self._model is not None:
            self.recorder.workload(self._model, self.lead, global_batch=samples or None)
        self.recorder.step(loss=loss, loss_scale=finite_scale, skipped=skipped, samples=samples or None)


def wrap_backward(cls: type, steps: Steps) -> None:
    original = cls.backward

    @functools.wraps(original)
    def backward(tensor: Any, gradient: Any = None, *args: Any, **kwargs: Any) -> Any:
        if gradient is not None or tensor.numel() != 1 or not tensor.requires_grad:
            return original(tensor, gradient, *args, **kwargs)
        result = original(steps.backward(tensor), gradient, *args, **kwargs)
        steps.after_backward()
        return result

    cls.backward = backward


def before_step(steps: Steps, optimizer: Any, args: Any, kwargs: Any) -> None:
    """Injected scaling (a global optimizer step pre-hook): unscale the optimizer's gradients and,
    where they overflowed, drop them, so that the step updates nothing (as GradScaler skips it)."""
    scaler = steps.scaling
    if scaler is None or scaler._scale is None:
        return
    state = scaler._per_optimizer_states[id(optimizer)]
    if state["stage"].name == "READY":
        scaler.unscale_(optimizer)
    if sum(v.item() for v in state["found_inf_per_device"].values()):
        for group in optimizer.param_groups:
            for p in group["params"]:
                p.grad = None  # a parameter without a gradient is not updated: the step is skipped
        steps.pending_step = (scaler.get_scale(), True)
    elif optimizer is steps.lead or steps.lead is None:
        steps.pending_step = (scaler.get_scale(), False)


def before_clip(steps: Steps) -> None:
    """Injected scaling: the gradients are unscaled before the script clips them."""
    scaler = steps.scaling
    if scaler is None or scaler._scale is None:
        return
    for optimizer in list(steps.optimizers):
        if scaler._per_optimizer_states[id(optimizer)]["stage"].name == "READY":
            scaler.unscale_(optimizer)


def _signature(module: Any) -> list[int]:
    """The versions of a model's parameters and of their gradients: an update by hand or zeroed
    gradients change it, a backward that accumulates into the same gradients does not."""
    return [v for p in module.parameters() for v in (p._version, -1 if p.grad is None else id(p.grad))]


def candidate_scaler_class(base: type, *, policy: Policy, steps: Steps) -> type:
    """A ``GradScaler`` subclass with the candidate's loss scaling, whatever the script asks; it
    lives on the device of the first loss it scales and ends the trial's step at ``step()``."""
    loss_scale = fp16_loss_scale(policy)
    enabled = loss_scale.kind != "none"
    static = float(loss_scale.init_scale) if loss_scale.kind == "static" else None
    steps.scaling_wanted = enabled

    class CandidateGradScaler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, count: bool = True, **kwargs: Any) -> None:
            import torch

            if count and steps.counting_scalers:
                steps.seen.scalers += 1
            device = "cuda" if torch.cuda.is_available() else "cpu"
            super().__init__(device, enabled=enabled, **scaler_kwargs(loss_scale))

        def scale(self, outputs: Any) -> Any:
            if self._enabled and self._scale is None and hasattr(outputs, "device"):
                self._device = outputs.device.type
            return steps.scaled(super().scale(outputs), outputs)

        def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            step = functools.partial(super().step, optimizer, *args, **kwargs)
            return steps.scaler_step(self, optimizer, step)

        def update(self, new_scale: Any = None) -> None:
            super().update(static if new_scale is None else new_scale)

    CandidateGradScaler.__qualname__ = CandidateGradScaler.__name__ = "GradScaler"
    steps.make_scaler = lambda: CandidateGradScaler(count=False)
    return CandidateGradScaler
