"""Lightning trials, recorded: the GradScaler a policy builds (it remembers each step's scale and
skip), and the feeds from the Trainer's callback hooks and Fabric's, one record per optimizer step.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from advisor.frameworks._adapter import StepLosses, around, batch_size_of, scaler_kwargs, wrap_once
from advisor.runtime import current_world_size
from policies import LossScale

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder


def as_list(value: Any) -> list[Any]:
    """A Trainer's or Fabric's ``plugins``/``callbacks`` argument as a list: none, one, or several."""
    return [] if value is None else list(value) if isinstance(value, (list, tuple)) else [value]


@functools.cache
def _scaler_class() -> type:
    import torch

    class PolicyGradScaler(torch.amp.GradScaler):
        """The GradScaler a policy's ``[loss_scale]`` builds; it remembers each step's scale and skip
        (a static scale stays fixed, while an overflowing step is still skipped)."""

        def __init__(self, device: str, loss_scale: LossScale) -> None:
            # kind "none": fp16 autocast without loss scaling, as the loop API's fp16-mixed runs it.
            super().__init__(device, **scaler_kwargs(loss_scale), enabled=loss_scale.kind != "none")
            self.static_scale = float(loss_scale.init_scale) if loss_scale.kind == "static" else None
            self._last_scale: float | None = None
            self._skipped = False

        def step(self, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.is_enabled():  # no scaling: nothing is scaled or skipped
                self._last_scale = None
                return super().step(optimizer, *args, **kwargs)
            scale = float(self.get_scale())  # before update(): the scale this step's backward used
            result = super().step(optimizer, *args, **kwargs)
            found = self._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            self._last_scale = scale
            self._skipped = self._skipped or any(v.item() for v in found.values())
            return result

        def update(self, new_scale: Any = None) -> None:
            super().update(self.static_scale if new_scale is None else new_scale)

        def take(self) -> tuple[float | None, bool]:
            """The scale of the latest step and whether any step since the last ``take()`` was skipped."""
            taken = (self._last_scale, self._skipped)
            self._skipped = False
            return taken

    # Found again by name (module.__getattr__ below), so that a spawned process can unpickle it.
    PolicyGradScaler.__module__, PolicyGradScaler.__qualname__ = __name__, "PolicyGradScaler"
    return PolicyGradScaler


def __getattr__(name: str) -> Any:
    # The scaler class is built on first use (torch is imported lazily), and named here so
    # that pickle finds it.
    if name == "PolicyGradScaler":
        return _scaler_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def policy_scaler(device: str, loss_scale: LossScale) -> Any:
    return _scaler_class()(device, loss_scale)


def take_step_scale(scaler: Any) -> tuple[float | None, bool]:
    """The loss scale and skip of the step that just ended, from a ``PolicyGradScaler``."""
    return scaler.take() if isinstance(scaler, _scaler_class()) else (None, False)


class TrainerSteps:
    """Feeds the recorder from a Lightning Trainer's callback hooks, one record per optimizer step.

    An optimizer step ended in a batch when ``trainer.global_step`` moved during it (on
    accumulation batches it does not). The batch's loss is ``outputs["loss"]``, which automatic
    optimization has divided by ``accumulate_grad_batches``; under manual optimization, where
    the training step may return nothing, it is the loss given to ``manual_backward``.
    """

    def __init__(self, recorder: FrameworkRecorder) -> None:
        self.recorder = recorder
        self.step = StepLosses()
        self._global_step_at_start = 0
        self._backward_loss: Any = None
        self._batch_size: int | None = None
        self._scale_before: float | None = None

    def trainer_kwargs(self, package: str, kwargs: dict[str, Any]) -> None:
        """The recording callback, and the Trainer's extras off where the script's callbacks allow."""
        callbacks_module = importlib.import_module(f"{package}.callbacks")
        callbacks = as_list(kwargs.get("callbacks"))

        def has(*names: str) -> bool:
            kinds = tuple(getattr(callbacks_module, n) for n in names if hasattr(callbacks_module, n))
            return any(isinstance(c, kinds) for c in callbacks)

        # Off in trials: they cost time per step and change no numerics. Each stays as the
        # script set it where one of its callbacks needs it (Lightning refuses the mix).
        off = {"enable_progress_bar": has("ProgressBar"), "enable_model_summary": has("ModelSummary"),
               "enable_checkpointing": has("Checkpoint"),
               "logger": has("LearningRateMonitor", "DeviceStatsMonitor")}
        turned = [name for name, needed in off.items() if not needed]
        kwargs.update(dict.fromkeys(turned, False))
        if turned:
            self.recorder.note(f"Lightning Trainer: {', '.join(turned)} off in the trial (no effect on the numerics)")
        # A Callback of the script's Lightning flavour whose hooks are this object's methods.
        hooks = ("on_train_start", "on_train_batch_start", "on_before_backward",
                 "on_before_optimizer_step", "on_train_batch_end")
        recorder = type("StepRecorder", (callbacks_module.Callback,),
                        {name: staticmethod(getattr(self, name)) for name in hooks})
        kwargs["callbacks"] = [*callbacks, recorder()]

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.recorder.set_device(pl_module.device)

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, *_: Any) -> None:
        size = batch_size_of(batch)
        if not self.recorder.begun:
            self.recorder.perturb(module)
            self.recorder.watch_model(module)
            accum = int(trainer.accumulate_grad_batches or 1)
            self.recorder.begin(user_batch=size, micro_batch=size, grad_accum_steps=accum)
            optimizers = trainer.optimizers
            # The workload's global batch counts every process (Lightning's world size).
            self.recorder.workload(module, optimizers[0] if optimizers else None,
                                   global_batch=None if size is None else size * accum * current_world_size())
        self._global_step_at_start = trainer.global_step
        self._backward_loss = None
        self._batch_size = size

    def on_before_backward(self, trainer: Any, module: Any, loss: Any) -> None:
        if module.automatic_optimization:
            return  # outputs["loss"] holds it, unscaled
        # manual_backward's loss arrives here already multiplied by the loss scale.
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        self._backward_loss = loss.detach().float() / scale

    def on_before_optimizer_step(self, trainer: Any, *_: Any) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        # A scaler the policy did not build (a sharded strategy's own): the scale before the
        # step, to tell a skip by the scale shrinking after it.
        if scaler is not None and not isinstance(scaler, _scaler_class()) and self._scale_before is None:
            self._scale_before = float(scaler.get_scale())

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *_: Any) -> None:
        if not self.recorder.begun:
            return
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs if hasattr(outputs, "detach") else None
        if loss is not None and module.automatic_optimization:
            loss = loss * trainer.accumulate_grad_batches  # automatic optimization divided it
        elif loss is None:
            loss = self._backward_loss
        self.step.add(loss, self._batch_size)
        if trainer.global_step == self._global_step_at_start:
            return  # an accumulation batch: no optimizer step yet
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        scale, skipped = take_step_scale(scaler)
        if self._scale_before is not None:
            scale, skipped = self._scale_before, float(scaler.get_scale()) < self._scale_before
            self._scale_before = None
        self.step.record(self.recorder, scale, skipped)


class FabricSteps:
    """Feeds the recorder from Fabric's ``on_after_optimizer_step`` callback, the losses given to
    ``fabric.backward`` (the step's micro-batches, their mean recorded as the script passed them)
    and a forward pre-hook on the model the script sets up for the batch size."""

    def __init__(self, recorder: FrameworkRecorder) -> None:
        self.recorder = recorder
        self.step = StepLosses()
        self.model: Any = None
        self._forward_batch: int | None = None
        self._hooked: set[int] = set()
        self._first_step = True

    def patch(self, fabric_cls: type) -> None:
        wrap_once(fabric_cls, "backward", around(self._backward))
        watch = around(lambda fabric, module, *args, **kwargs: self.watch(module))
        wrap_once(fabric_cls, "setup", watch)
        wrap_once(fabric_cls, "setup_module", watch)

    def _backward(self, fabric: Any, tensor: Any, *args: Any, **kwargs: Any) -> None:
        if not self.recorder.begun:
            size = self._forward_batch
            # The accumulation count is known at the first optimizer step.
            self.recorder.begin(user_batch=size, micro_batch=size, grad_accum_steps=None)
        self.step.add(tensor, self._forward_batch)

    def watch(self, module: Any) -> None:
        if id(module) in self._hooked or not hasattr(module, "register_forward_pre_hook"):
            return
        self._hooked.add(id(module))
        if self.model is None:
            self.model = module
            self.recorder.watch_model(module)

        def pre_hook(mod: Any, args: Any, kwargs: Any) -> None:
            import torch

            if torch.is_grad_enabled():
                self.recorder.perturb(mod)
                size = batch_size_of((args, kwargs))
                if size is not None:
                    self._forward_batch = size

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        if not self.recorder.begun or not self.step.micro_batches:
            return
        if self._first_step:
            self._first_step = False
            accum = self.step.micro_batches
            micro = self.recorder.batch.get("micro_batch")
            global_batch = None if micro is None else micro * accum
            # The batch facts written at begin() lacked the accumulation count.
            self.recorder.batch.update(grad_accum_steps=accum, global_batch=global_batch)
            every_process = None if global_batch is None else global_batch * current_world_size()
            self.recorder.workload(self.model, optimizer, global_batch=every_process)
        scale, skipped = take_step_scale(getattr(strategy.precision, "scaler", None))
        self.step.record(self.recorder, scale, skipped)
