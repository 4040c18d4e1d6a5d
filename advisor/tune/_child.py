"""Inside a trial's child process: what ``load_policy()`` does when ``mpadvise tune`` or
``mpadvise trial`` injected a candidate, and the recorder that ``step()`` feeds.

The recorder times optimizer steps (the device synchronised at the edges of the measured
window; CUDA events in between), records loss, loss scale, skipped steps, fp16 gradient
underflow and peak memory, then writes the result file and ends the process.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from advisor.runtime._applied import AppliedPolicy, StepObserver
from policies import Policy, PolicyError, supported_modes
from probes import HardwareProfile
from probes._trial import EXIT_NO_STEP, EXIT_UNSUPPORTED, TrialSpec, json_float

if TYPE_CHECKING:
    import torch

TRIAL_SPEC_ENV = "MPADVISE_TRIAL_SPEC"

# fp16's smallest normal value. Gradients whose scaled magnitude falls below it are subnormal:
# they have lost precision, and the next loss-scale backoff flushes them to zero.
FP16_MIN_NORMAL = 2.0**-14
UNDERFLOW_SAMPLE = 1024  # values sampled per gradient tensor: cheap, and enough for a fraction
_CHILD_APPLIED: AppliedPolicy | None = None


class TrialComplete(BaseException):
    """Ends an in-process trial once its window is measured (a BaseException, so that a
    training function's ``except Exception`` does not swallow it)."""


def spec_from_env() -> TrialSpec | None:
    """The trial spec injected into this process, or ``None`` in a plain run."""
    path = os.environ.get(TRIAL_SPEC_ENV)
    if not path:
        return None
    return TrialSpec.from_json(Path(path).read_text())


class ResultWriter:
    """Writes the result file atomically, so the parent never reads half a file."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.data: dict[str, Any] = {}

    def write(self, **fields: Any) -> None:
        self.data.update(fields)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, default=str))
        tmp.replace(self.path)


def seed_everything(seed: int) -> None:
    """Same seed in every trial: data order and initial weights match, curves compare."""
    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional for torch
        pass
    else:
        np.random.seed(seed)


def applied_for_trial(spec: TrialSpec, *, profile: HardwareProfile, device: str | None) -> AppliedPolicy:
    """Build the AppliedPolicy for the injected candidate, with a recorder attached.

    In the trial child process: an unsupported candidate ends the process with
    ``EXIT_UNSUPPORTED``; uncaught exceptions are recorded for the parent.
    """
    global _CHILD_APPLIED
    if _CHILD_APPLIED is not None:  # a script that calls load_policy() twice gets one recorder
        return _CHILD_APPLIED
    writer = ResultWriter(spec.result_path)
    writer.write(stage="loaded", pid=os.getpid())
    _install_excepthook(writer)
    applied = _build(spec, writer, profile=profile, device=device, in_process=False)
    if applied is None:
        _exit(EXIT_UNSUPPORTED)
    _CHILD_APPLIED = applied
    return applied


def _build(
    spec: TrialSpec, writer: ResultWriter, *, profile: HardwareProfile, device: str | None, in_process: bool
) -> AppliedPolicy | None:
    try:
        policy = Policy.from_dict(spec.policy, source="trial spec")
    except PolicyError as exc:
        writer.write(stage="unsupported", reason=str(exc))
        return None
    support = supported_modes(profile)[policy.mode]
    if not support.supported:
        writer.write(stage="unsupported", reason=f"{policy.mode} cannot run on {profile.name}: {support.reason}")
        return None
    seed_everything(spec.seed)
    recorder = TrialRecorder(spec, writer, in_process=in_process)
    applied = AppliedPolicy(policy, profile=profile, source=f"trial {spec.label or policy.mode}", device=device, observer=recorder)
    recorder.attach(applied)
    return applied


def run_in_process(train_fn: Any, spec: TrialSpec, *, profile: HardwareProfile) -> tuple[dict[str, Any], str | None]:
    """Run ``train_fn(mp)`` as one trial in this process.

    Returns:
        The result data (as a child would have written it) and the error text when
        ``train_fn`` raised, else ``None``.
    """
    import traceback

    writer = ResultWriter(spec.result_path)
    writer.write(stage="loaded")
    applied = _build(spec, writer, profile=profile, device=spec.device, in_process=True)
    if applied is None:
        return writer.data, None
    recorder = applied._observer
    assert isinstance(recorder, TrialRecorder)
    error = None
    try:
        train_fn(applied)
    except TrialComplete:
        pass
    except Exception as exc:  # the trial's outcome, not ours: classify it
        message = str(exc).splitlines()[0] if str(exc) else ""
        writer.write(stage="exception", exception={"type": type(exc).__name__, "message": message})
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    else:
        if recorder._stepped_once:
            recorder.finish(complete=False)
    return writer.data, error


class TrialRecorder(StepObserver):
    """Records every optimizer step of a trial and ends the process after the measured window."""

    def __init__(self, spec: TrialSpec, writer: ResultWriter, *, in_process: bool = False) -> None:
        self.spec = spec
        self.in_process = in_process
        self.writer = writer
        self.applied: AppliedPolicy | None = None
        self.losses: list[Any] = []  # loss tensors, read once at the end (no sync per step)
        self.loss_scale: list[float | None] = []
        self.skipped: list[bool] = []
        self.underflow: list[float | None] = []
        self.samples: list[int] = []
        self.marks: list[Any] = []  # one time mark (float or CUDA event) per step boundary
        self._micro_losses: list[Any] = []
        self._micro_samples = 0
        self._stepped_once = False
        self._finished = False
        self._watchdog: threading.Timer | None = None
        self._cuda = False

    def attach(self, applied: AppliedPolicy) -> None:
        import torch

        self.applied = applied
        self._cuda = applied.device.type == "cuda"
        if self._cuda:
            if self.spec.memory_limit:
                total = torch.cuda.get_device_properties(applied.device).total_memory
                torch.cuda.set_per_process_memory_fraction(min(1.0, self.spec.memory_limit / total), applied.device)
            torch.cuda.reset_peak_memory_stats(applied.device)
        if self.in_process:
            return  # no watchdog or exit hooks: the caller owns this process
        self._watchdog = threading.Timer(self.spec.no_step_timeout, self._no_step)
        self._watchdog.daemon = True
        self._watchdog.start()
        atexit.register(self._at_exit)

    # ---- StepObserver -----------------------------------------------------------------------

    def before_step(self, applied: AppliedPolicy) -> None:
        if not self._stepped_once:
            self._stepped_once = True
            if self._watchdog is not None:
                self._watchdog.cancel()
            self.writer.write(stage="stepping", **self._batch_facts(applied))
            self._sync()
            self.marks.append(self._mark())

    def after_backward(self, applied: AppliedPolicy, optimizer: torch.optim.Optimizer) -> None:
        if applied.mode.startswith("fp16"):
            self.underflow.append(self._underflow_fraction(applied, optimizer))
        else:
            self.underflow.append(None)

    def after_step(self, applied: AppliedPolicy, *, loss: Any, stepped: bool, optimizer_step: bool) -> None:
        self._micro_losses.append(loss.detach())
        self._micro_samples += applied.last_batch_size or 0
        if not optimizer_step:
            return
        micro = self._micro_losses
        self.losses.append(micro[0] if len(micro) == 1 else sum(m.float() for m in micro) / len(micro))
        self.samples.append(self._micro_samples)
        self._micro_losses, self._micro_samples = [], 0
        self.loss_scale.append(applied.loss_scale())
        self.skipped.append(not stepped)
        n = len(self.losses)
        if n == self.spec.warmup_steps:
            self._sync()  # edge of the measured window
        self.marks.append(self._mark())
        if n >= self.spec.warmup_steps + self.spec.measure_steps:
            self.finish(complete=True)

    # ---- measuring ----------------------------------------------------------------------------

    def _mark(self) -> Any:
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _sync(self) -> None:
        if self._cuda:
            import torch

            torch.cuda.synchronize()

    def _step_times(self) -> list[float]:
        if self._cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        return [b - a for a, b in zip(self.marks, self.marks[1:])]

    def _underflow_fraction(self, applied: AppliedPolicy, optimizer: torch.optim.Optimizer) -> float | None:
        import torch

        scale = applied.loss_scale() or 1.0
        small = total = 0
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    flat = p.grad.detach().reshape(-1)
                    stride = max(1, flat.numel() // UNDERFLOW_SAMPLE)
                    sample = flat[::stride].float().abs() * scale
                    nonzero = sample[(sample > 0) & torch.isfinite(sample)]
                    total += int(nonzero.numel())
                    small += int((nonzero < FP16_MIN_NORMAL).sum())
        return small / total if total else None

    def _peak_memory(self) -> tuple[int | None, str]:
        if self._cuda:
            import torch

            return int(torch.cuda.max_memory_allocated(self.applied.device)), "cuda-peak-allocated"
        try:
            import resource
        except ImportError:  # not on Windows
            return None, ""
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        # Linux reports KiB, macOS bytes.
        return int(rss if sys.platform == "darwin" else rss * 1024), "cpu-peak-rss"

    def _batch_facts(self, applied: AppliedPolicy) -> dict[str, Any]:
        return {
            "user_batch": applied.user_batch,
            "micro_batch": applied.policy.micro_batch_size or applied.user_batch,
            "grad_accum_steps": applied.grad_accum_steps,
            "global_batch": applied.global_batch,
            "device": str(applied.device),
        }

    def finish(self, *, complete: bool) -> None:
        """Write the result; with ``complete`` also end the process (the trial has its data)."""
        if self._finished:
            return
        self._finished = True
        self._sync()
        applied = self.applied
        assert applied is not None
        peak, kind = self._peak_memory()
        losses = [float(v) for v in self.losses]
        self.writer.write(
            stage="done",
            complete=complete,
            losses=[json_float(v) for v in losses],
            step_times=self._step_times(),
            loss_scale=self.loss_scale,
            skipped=self.skipped,
            underflow=self.underflow,
            samples=self.samples,
            warmup_steps=self.spec.warmup_steps,
            peak_memory=peak,
            memory_kind=kind,
            notes=applied.notes,
            workload_fingerprint=applied.workload_fingerprint,
            model_signature=applied.model_signature,
            **self._batch_facts(applied),
        )
        if complete:
            if self.in_process:
                raise TrialComplete
            _exit(0)

    def _no_step(self) -> None:
        self.writer.write(stage="no-step")
        _exit(EXIT_NO_STEP)

    def _at_exit(self) -> None:
        # The script ended by itself before the measured window was full: keep what it measured.
        if self._stepped_once and not self._finished and self.writer.data.get("stage") != "exception":
            self.finish(complete=False)


def _install_excepthook(writer: ResultWriter) -> None:
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            writer.write(stage="exception", exception={"type": exc_type.__name__, "message": str(exc).splitlines()[0] if str(exc) else ""})
        previous(exc_type, exc, tb)

    sys.excepthook = hook


def _exit(code: int) -> None:
    """End the trial child now: the result is written, the script's remaining work is not needed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
