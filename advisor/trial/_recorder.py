"""The trial recorder for a framework script: fed by the framework's own hooks, it writes the
same result file as the loop API's recorder (``_loop_recorder``). The adapter calls
``policy_applied()`` once the framework's trainer is built with the candidate, ``begin()``
before the first batch, ``step()`` once per optimizer step and ``workload()`` once the model and
optimizer exist.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from advisor.runtime import Workload

from ._device import DeviceClock
from ._loop_recorder import optimizer_eps
from ._schema import Stage, TrialSpec
from ._step_window import ResultWriter, StepWindow
from ._timeline import mark


class FrameworkRecorder(StepWindow):
    def __init__(self, spec: TrialSpec, writer: ResultWriter, *, device: Any = "cpu") -> None:
        super().__init__(spec, writer)
        self.set_device(device)
        self.notes: list[str] = []
        self.batch: dict[str, Any] = {}
        self.workload_fingerprint: str | None = None
        self.model_signature: str | None = None
        self.fsdp = False  # asked for through mp.fsdp_mixed_precision(), which a framework script never calls

    def set_device(self, device: Any) -> None:
        """The device the framework trains on: CUDA events time its steps, else the host clock."""
        self.device = str(device)
        if not self.device.startswith("cuda"):
            self.clock = DeviceClock(None)
            return
        import torch

        self.clock = DeviceClock(torch.device(self.device))

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def begin(self, *, user_batch: int | None, micro_batch: int | None, grad_accum_steps: int | None) -> None:
        """The first batch starts: the clock's first mark (later calls do nothing)."""
        if self.begun:
            return
        mark("policy_applied")  # unless the adapter saw the object built: it runs the candidate now
        accum = grad_accum_steps or 1
        self.batch = {
            "user_batch": user_batch,
            "micro_batch": micro_batch,
            "grad_accum_steps": accum,
            "global_batch": None if micro_batch is None else micro_batch * accum,
            "device": self.device,
        }
        self._begin(self.batch)

    def perturb(self, model: Any) -> None:
        """The fp32 replicate's one perturbation, before the first training forward."""
        if model is not None and hasattr(model, "parameters") and self._perturb(model):
            self.note(f"fp32 replicate: initial parameters perturbed once by a {self.spec.perturb} rounding")

    def workload(self, model: Any, optimizer: Any | None, *, global_batch: int | None) -> None:
        """Fingerprint the workload (the script's model, optimizer and global batch), once."""
        if self.workload_fingerprint is not None:
            return
        script = sys.argv[0] if sys.argv and sys.argv[0] else None
        work = Workload.of(model, optimizer, global_batch=global_batch, script=script, args=sys.argv[1:])
        self.workload_fingerprint = work.fingerprint()
        self.model_signature = work.model
        self.optimizer_eps = optimizer_eps(optimizer)

    def step(self, *, loss: Any, loss_scale: float | None = None, skipped: bool = False,
             samples: int | None = None) -> None:
        """One optimizer step ended: its loss averaged over its micro-batches (not divided by the
        accumulation count), the scale its backward ran with, whether the scaler skipped it."""
        if self._finished or not self.begun:
            return
        self.losses.append(loss.detach().clone() if hasattr(loss, "detach") else loss)
        self.loss_scale.append(loss_scale)
        self.skipped.append(bool(skipped))
        self.samples.append(int(samples or self.batch.get("global_batch") or 0))
        self._end_of_step(len(self.losses))


def recorder_for(spec: TrialSpec) -> FrameworkRecorder:
    writer = ResultWriter(spec.result_path)
    writer.write(stage=Stage.LOADED, pid=os.getpid())
    return FrameworkRecorder(spec, writer, device=spec.device or "cpu")
