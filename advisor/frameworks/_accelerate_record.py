"""Accelerate trials, recorded: one record per optimizer step from the Accelerator's own methods
(``backward``, ``prepare``, ``AcceleratedOptimizer.step``) and a forward pre-hook for the batch size.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from advisor.frameworks._adapter import StepLosses
from advisor.runtime import current_world_size

if TYPE_CHECKING:
    from advisor.trial import FrameworkRecorder

def as_built(model: Any) -> Any:
    """A model as the script built it, before Accelerate's FP8 conversion swaps its Linears: what
    the workload fingerprint describes, as the loop API fingerprints it before its mode converts it."""
    modules, parameters = tuple(model.named_modules()), tuple(model.named_parameters())
    return types.SimpleNamespace(named_modules=lambda: modules, named_parameters=lambda: parameters)


class Steps:
    """Feeds the recorder from one Accelerator's methods, one record per optimizer step.

    A step's micro-batches are the ``backward()`` calls since the last optimizer step; its loss is
    the mean of the losses passed to ``backward()`` (Accelerate divides them only inside). Only
    the first optimizer prepared is followed (a GAN's second one steps in the same loop).
    """

    def __init__(self, recorder: FrameworkRecorder) -> None:
        self.recorder = recorder
        self.accelerators: list[Any] = []
        self.fp8_mode: Any = None
        self.model: Any = None  # the first model prepared, as built
        self.optimizer: Any = None  # the first AcceleratedOptimizer prepared
        self._as_built: dict[int, Any] = {}
        self._hooked: set[int] = set()
        self._forward_batch: int | None = None
        self.step = StepLosses()
        self._first_step = True
        self._fp8_noted = False

    def before_prepare(self, accelerator: Any, *args: Any, **kwargs: Any) -> None:
        import torch

        for arg in args:
            if isinstance(arg, torch.nn.Module) and id(arg) not in self._as_built:
                self._as_built[id(arg)] = as_built(arg)

    def wrap_prepare_model(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_model(accelerator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
            built = self._as_built.get(id(model)) or as_built(model)
            prepared = original(accelerator, model, *args, **kwargs)
            self._watch(prepared, built)
            return prepared

        return prepare_model

    def wrap_prepare_optimizer(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def prepare_optimizer(accelerator: Any, *args: Any, **kwargs: Any) -> Any:
            prepared = original(accelerator, *args, **kwargs)
            if self.optimizer is None:
                self.optimizer = prepared
            return prepared

        return prepare_optimizer

    def before_backward(self, accelerator: Any, loss: Any, *args: Any, **kwargs: Any) -> None:
        if not self.recorder.begun:
            self._begin(accelerator)
        self.step.add(loss, self._forward_batch)

    def wrap_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
            if optimizer is not self.optimizer or not optimizer.gradient_state.sync_gradients:
                return original(optimizer, *args, **kwargs)  # not followed, or an accumulation micro-batch
            scaler = optimizer.scaler
            scaled = scaler is not None and scaler.is_enabled()
            scale = float(scaler.get_scale()) if scaled else None  # the scale this step's backward used
            result = original(optimizer, *args, **kwargs)
            if self.recorder.begun and self.step.losses:  # not a step before any backward()
                if self._first_step:
                    self._first_step = False
                    _first_step_facts(self.recorder, self.model, optimizer, self.step.micro_batches)
                self.step.record(self.recorder, scale, bool(scaled and optimizer.step_was_skipped))
            return result

        return step

    def _watch(self, model: Any, built: Any) -> None:
        if id(model) in self._hooked or not hasattr(model, "register_forward_pre_hook"):
            return
        self._hooked.add(id(model))
        if self.model is None:
            self.model = built
            self.recorder.watch_model(model)
        import torch
        from accelerate.utils.operations import ignorant_find_batch_size

        def pre_hook(module: Any, args: Any, kwargs: Any) -> None:
            if torch.is_grad_enabled() and module.training:
                self.recorder.perturb(module)
                size = ignorant_find_batch_size(args) or ignorant_find_batch_size(kwargs)
                if size is not None:
                    self._forward_batch = int(size)
                if not self.recorder.begun and self.accelerators:
                    self._begin(self.accelerators[0])

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)

    def _begin(self, accelerator: Any) -> None:
        size = self._forward_batch
        accum = int(accelerator.gradient_accumulation_steps or 1)
        self.recorder.begin(user_batch=None if size is None else size * accum, micro_batch=size, grad_accum_steps=accum)

    def note_fp8(self, accelerator: Any) -> None:
        """After ``prepare()`` swapped the FP8 layers: which run in FP8 and which do not."""
        mode = self.fp8_mode
        if mode is None or self._fp8_noted or not (mode.converted or mode.kept_high_precision):
            return
        self._fp8_noted = True
        mode.note_conversion()
        notes = list(mode.notes)
        if mode.converted:
            notes.append(f"{mode.name}: Accelerate swapped {len(mode.converted)} Linear layers for torchao's Float8Linear")
        if mode.device.type == "cpu":
            notes.append(f"{mode.name}: emulated on CPU (FP8 numerics, no speedup), under Accelerate's bf16 autocast")
        for note in notes:
            self.recorder.note(note)


def _first_step_facts(recorder: FrameworkRecorder, model: Any, optimizer: Any, micro_batches: int) -> None:
    """The accumulation the script really runs, known at its first optimizer step, and the workload."""
    batch = recorder.batch
    accum = batch.get("grad_accum_steps") or 1
    if micro_batches != accum:
        # The script accumulates by itself (backward() several times per optimizer step
        # with Accelerate's accumulation at 1); if it divides the loss, so do the records.
        recorder.note(
            f"the script runs {micro_batches} backward() per optimizer step where Accelerate's "
            f"gradient_accumulation_steps is {accum}: it accumulates by itself"
        )
        accum = micro_batches
    micro = batch.get("micro_batch")
    global_batch = None if micro is None else micro * accum
    batch.update(grad_accum_steps=accum, global_batch=global_batch, user_batch=global_batch)
    if model is None:
        recorder.note("the script's model was not passed to accelerator.prepare(), so Accelerate's "
                    "autocast and FP8 conversion never applied to it")
    else:
        # The workload's global batch counts every process; the step's samples stay this one's.
        every_process = None if global_batch is None else global_batch * current_world_size()
        recorder.workload(model, optimizer.optimizer, global_batch=every_process)
