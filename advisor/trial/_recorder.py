"""The trial recorder for a framework script: fed by the framework's own hooks, it writes the
same result file as the loop API's recorder (``advisor.trial._loop_recorder``), so the parent judges a
Lightning, Hugging Face or Accelerate trial exactly as it judges any other.

The framework's adapter calls ``policy_applied()`` once the framework's object that trains
(a Trainer, Fabric or Accelerator) is built with the candidate's settings, which starts the
first-step watchdog; its hooks call ``begin()`` before the first batch, ``step()`` once per
optimizer step (with the step's mean loss over its micro-batches, the loss scale its backward
ran with, and whether the scaler skipped it) and ``workload()`` once the model and optimizer
exist.
After the warm-up and measured steps the result is written and the process ends, as a loop
API trial does.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from advisor.runtime import Workload

from ._child_exit import ResultWriter
from ._device import DeviceClock
from ._flops import StepFlops
from ._schema import Stage, TrialSpec
from ._seeding import perturb_parameters
from ._step_window import StepWindow
from ._timeline import mark, marks
from ._underflow import optimizer_eps
from ._watchdog import NoStepWatchdog


class FrameworkRecorder(StepWindow):
    """Records every optimizer step of a framework script's trial.

    Args:
        spec: the injected trial spec (window, seed, limits).
        writer: the result file.
        device: the device the framework trains on (``"cpu"``, ``"cuda:0"``); its type decides
            how steps are timed (CUDA events, else the host clock).
    """

    def __init__(self, spec: TrialSpec, writer: ResultWriter, *, device: Any = "cpu") -> None:
        self.spec = spec
        self.writer = writer
        self.device = str(device)
        self.clock = _clock_for(self.device)
        self.losses: list[Any] = []
        self.loss_scale: list[float | None] = []
        self.skipped: list[bool] = []
        self.samples: list[int] = []
        self.marks: list[Any] = []
        self.notes: list[str] = []
        self.batch: dict[str, Any] = {}
        self.workload_fingerprint: str | None = None
        self.model_signature: str | None = None
        self.fsdp = False  # asked for through mp.fsdp_mixed_precision(), which a framework script never calls
        self._begun = False
        self._perturbed = False
        self._finished = False
        self._watchdog: NoStepWatchdog | None = None
        self._flops = StepFlops.for_spec(spec)

    def start(self) -> None:
        """Keep a short run's steps at exit. The first-step watchdog waits for ``policy_applied``:
        until the framework's object is built, nothing of the candidate has run."""
        self._keep_short_run()

    def policy_applied(self) -> None:
        """The framework's Trainer, Fabric or Accelerator is built with the candidate's settings:
        mark it, and give the script ``spec.first_step_timeout`` from now to its first optimizer
        step (later calls, from further objects the script builds, do nothing)."""
        self._policy_applied(watch=True)

    def set_device(self, device: Any) -> None:
        """The device the framework chose (known once its trainer exists)."""
        self.device = str(device)
        self.clock = _clock_for(self.device)

    def note(self, text: str) -> None:
        """A sentence for the trial's report (how the framework applied the candidate)."""
        if text not in self.notes:
            self.notes.append(text)

    def begin(self, *, user_batch: int | None, micro_batch: int | None, grad_accum_steps: int | None) -> None:
        """The first batch starts: the clock's first mark (later calls do nothing)."""
        if self._begun:
            return
        self._begun = True
        if "policy_applied" not in marks():
            mark("policy_applied")  # an object the adapter did not see built: it runs the candidate now
        if self._watchdog is not None:
            self._watchdog.cancel()
        accum = grad_accum_steps or 1
        self.batch = {
            "user_batch": user_batch,
            "micro_batch": micro_batch,
            "grad_accum_steps": accum,
            "global_batch": None if micro_batch is None else micro_batch * accum,
            "device": self.device,
        }
        self.writer.write(stage=Stage.STEPPING, **self.batch)
        self._open_window()

    def perturb(self, model: Any) -> None:
        """The fp32 replicate's one perturbation of the initial parameters (``spec.perturb``),
        applied where the adapter applies the policy, before the first training forward; once,
        and only in a replicate's trial."""
        if not self.spec.perturb or self._perturbed or model is None or not hasattr(model, "parameters"):
            return
        self._perturbed = True
        perturb_parameters(model, perturb=self.spec.perturb, seed=self.spec.seed, draw=self.spec.perturb_draw)
        self.note(f"fp32 replicate: initial parameters perturbed once by a {self.spec.perturb} rounding")

    @property
    def begun(self) -> bool:
        return self._begun

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
        """One optimizer step ended.

        Args:
            loss: the step's loss (a tensor is read once, at the end), averaged over its
                micro-batches and not divided by the accumulation count.
            loss_scale: the scale its backward ran with (fp16 with a GradScaler), else ``None``.
            skipped: whether the scaler skipped the optimizer step (overflowing gradients).
            samples: samples the step consumed (over all its micro-batches).
        """
        if self._finished or not self._begun:
            return
        self.losses.append(loss.detach().clone() if hasattr(loss, "detach") else loss)
        self.loss_scale.append(loss_scale)
        self.skipped.append(bool(skipped))
        self.samples.append(int(samples or self.batch.get("global_batch") or 0))
        self._end_of_step(len(self.losses))

    def _stepping(self) -> bool:
        return self._begun

    def _step_times(self) -> list[float]:
        return [DeviceClock.elapsed(a, b) for a, b in zip(self.marks, self.marks[1:])]

def _clock_for(device: str) -> DeviceClock:
    """The clock of a framework's device: CUDA events on a CUDA device, else the host clock."""
    if not device.startswith("cuda"):
        return DeviceClock(None)
    import torch

    return DeviceClock(torch.device(device))


def recorder_for(spec: TrialSpec) -> FrameworkRecorder:
    """The recorder of the trial this process runs, its result file started."""
    writer = ResultWriter(spec.result_path)
    writer.write(stage=Stage.LOADED, pid=os.getpid())
    return FrameworkRecorder(spec, writer, device=spec.device or "cpu")
