"""The loop API's trial recorder: fed by ``step()``, it records every optimizer step of a trial.
Its own work inside a step runs between two time marks, and that interval is cut out of the
step's time: a trial times the user's step, not its measuring.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from advisor.runtime import AppliedPolicy, StepObserver
from policies import mode_facts

from ._device import DeviceClock, TrialDevice
from ._schema import TrialSpec
from ._step_window import ResultWriter, StepWindow
from ._underflow import (
    UNDERFLOW_EVERY,
    gradients,
    optimizer_eps,
    underflow_counts,
    underflow_fractions,
)

if TYPE_CHECKING:
    import torch


class TrialRecorder(StepObserver, StepWindow):
    def __init__(self, spec: TrialSpec, writer: ResultWriter, *, in_process: bool = False) -> None:
        StepWindow.__init__(self, spec, writer)
        self.in_process = in_process
        self.applied: AppliedPolicy | None = None
        self.underflow: list[Any] = []  # [flushed, nonzero] count tensors, read once at the end
        self._in_step: dict[str, Any] = {}  # what after_backward measured, until after_step keeps it
        self._micro_losses: list[Any] = []
        self._micro_samples = 0
        self.clock = DeviceClock(None)
        self._device: TrialDevice | None = None  # from attach(): the device made current, its memory

    def attach(self, applied: AppliedPolicy) -> None:
        self.applied = applied
        self._device = TrialDevice(applied.device, memory_limit=self.spec.memory_limit, in_process=self.in_process)
        self.clock = self._device.clock
        if not self.in_process:  # in process, the caller owns the process and its exit
            self._keep_short_run()
        self._policy_applied()

    def after_setup(self, applied: AppliedPolicy, model: Any) -> None:
        # After the mode converted the model (fp32 leaves it as it is), before any step used it.
        self._perturb(model)
        self.watch_model(model)

    def before_step(self, applied: AppliedPolicy) -> None:
        if not self.begun:
            self._begin(batch_facts(applied))

    def after_backward(self, applied: AppliedPolicy, optimizer: torch.optim.Optimizer) -> None:
        # Everything here is the recorder's, not the user's: it runs between two marks that
        # finish() cuts out of the step's time. Here rather than after the optimizer step,
        # because a loss-scaling mode synchronises the device just after this point anyway
        # (to read the overflow flag), so the scale's read and the sampling add no wait of
        # their own to the rest of the step.
        start = self.clock.mark()
        if not self.losses:
            self.optimizer_eps = optimizer_eps(optimizer)
        scale = applied.loss_scale()
        counts = None
        facts = mode_facts(applied.mode)
        if "fp16" in (facts.autocast, facts.weights) and len(self.losses) % UNDERFLOW_EVERY == 0:
            counts = underflow_counts(gradients(optimizer), scale=scale or 1.0)
        self._in_step = {"loss_scale": scale, "underflow": counts, "pause": (start, self.clock.mark())}

    def after_step(self, applied: AppliedPolicy, *, loss: Any, stepped: bool, optimizer_step: bool) -> None:
        # A copy, not a view: under torch.compile(mode="reduce-overhead") the loss lives in a
        # CUDA graph's output memory, which the next replay overwrites (or frees, so that
        # reading it raises). The copy is one scalar kernel, queued without a host sync.
        self._micro_losses.append(loss.detach().clone())
        self._micro_samples += applied.micro_step_samples or 0
        if not optimizer_step:
            return
        micro = self._micro_losses
        self.losses.append(micro[0] if len(micro) == 1 else sum(m.float() for m in micro) / len(micro))
        self.samples.append(self._micro_samples)
        self._micro_losses, self._micro_samples = [], 0
        measured, self._in_step = self._in_step, {}
        self.loss_scale.append(measured.get("loss_scale"))
        self.underflow.append(measured.get("underflow"))
        self.pauses.append(measured.get("pause"))
        self.skipped.append(not stepped)
        self._end_of_step(len(self.losses))

    def _peak_memory(self) -> tuple[int | None, str]:
        return self.clock.peak_memory() if self._device is None else self._device.peak_memory()

    def _underflow(self) -> tuple[list[float | None], str | None]:
        return underflow_fractions(self.underflow)

    # What the result says of the workload, read from the applied policy (attached before any step).
    notes = property(lambda self: list(self.applied.notes))
    workload_fingerprint = property(lambda self: self.applied.workload_fingerprint)
    model_signature = property(lambda self: self.applied.model_signature)
    fsdp = property(lambda self: self.applied.fsdp)
    batch = property(lambda self: batch_facts(self.applied))

    def close(self) -> None:
        """Stop the RSS sampler and a FLOP count in progress, and give back the current device."""
        if self._flops is not None:
            self._flops.stop(discard=True)  # the training function raised inside the counted step
        if self._device is not None:
            self._device.close()


def batch_facts(applied: AppliedPolicy) -> dict[str, Any]:
    return {"user_batch": applied.user_batch, "micro_batch": applied.policy.micro_batch_size or applied.user_batch,
            "grad_accum_steps": applied.grad_accum_steps, "global_batch": applied.global_batch,
            "device": str(applied.device)}
