"""What both trial recorders (``_loop_recorder``, ``_recorder``) share: the measured window of
optimizer steps, the ways a trial child ends, and the result's measurements (``result_payload``).
"""

from __future__ import annotations

import atexit
import sys
from collections.abc import Callable
from typing import Any

from ._child_exit import ResultWriter, TrialComplete, end_trial_process
from ._device import DeviceClock
from ._flops import StepFlops
from ._schema import EXIT_NO_STEP, Stage, TrialSpec, json_float
from ._timeline import mark
from ._watchdog import NoStepWatchdog


class StepWindow:
    """The measured window of optimizer steps, timed on one DeviceClock, and the three ways a
    trial child ends (the window is full; no step came in time; the script ended first).

    A subclass sets ``clock`` and what it recorded of the workload (``notes``,
    ``workload_fingerprint``, ``model_signature``, ``fsdp``, ``batch``), and defines
    ``_stepping`` (whether the first step has begun) and ``_step_times``.
    """

    clock: DeviceClock
    in_process = False
    optimizer_eps: float | None = None

    def __init__(self, spec: TrialSpec, writer: ResultWriter) -> None:
        self.spec, self.writer = spec, writer
        self.losses: list[Any] = []  # loss tensors, read once at the end (no sync per step)
        self.loss_scale: list[float | None] = []
        self.skipped: list[bool] = []
        self.samples: list[int] = []
        self.marks: list[Any] = []  # one time mark (float or CUDA event) per step boundary
        self._perturbed = self._finished = False
        self._watchdog: NoStepWatchdog | None = None
        self._flops = StepFlops.for_spec(spec)

    def _stepping(self) -> bool:
        raise NotImplementedError

    def _step_times(self) -> list[float]:
        raise NotImplementedError

    def _peak_memory(self) -> tuple[int | None, str]:
        return self.clock.peak_memory()

    def _underflow(self) -> tuple[list[float | None], str | None]:
        """Per step, the fp16 gradient underflow fraction, and a note on it for the report."""
        return [None] * len(self.losses), None

    def finish(self, *, complete: bool) -> None:
        """Write the result; with ``complete`` also end the trial (it has its data): the process,
        or in process the training function (``TrialComplete``)."""
        if self._finished:
            return
        self._finished = True
        if self._flops is not None:
            self._flops.stop(discard=True)  # a run that ended inside the counted step counted part of it
        self.clock.sync()
        self.writer.write(**result_payload(self, complete=complete))
        if complete:
            if self.in_process:
                raise TrialComplete
            end_trial_process(0)

    def _keep_short_run(self) -> None:
        atexit.register(self._at_exit)

    def _policy_applied(self, *, watch: bool) -> None:
        """The candidate is applied: mark it, and with ``watch`` (a child process) give the script
        ``spec.first_step_timeout`` from now (not from the process's start: imports and the
        script's own set-up are no part of the candidate's cost) to its first optimizer step."""
        mark("policy_applied")
        if watch:
            # Written at once: a child ended before its first step (a timeout, a signal, a peer
            # rank's failure) was past the candidate's application, which decides ``lost``.
            self.writer.write()
        if watch and self._watchdog is None and not self._stepping():
            self._watchdog = NoStepWatchdog(self.spec.first_step_timeout, self._no_step)
            self._watchdog.start()

    def watch_model(self, model: Any) -> None:
        """The model the script trains, for the FLOP estimate where counting fails."""
        if self._flops is not None:
            self._flops.watch(model)

    def _open_window(self) -> None:
        self.clock.sync()
        self.marks.append(self.clock.mark())
        if self.spec.warmup_steps == 0:
            mark("warmup_done")

    def _end_of_step(self, steps: int) -> None:
        """Mark the end of optimizer step number ``steps``; a full window ends the trial. The FLOP
        counter runs between the marks of the counted step, so its cost falls in no other step."""
        flops, warmup = self._flops, self.spec.warmup_steps
        if flops is not None and steps == flops.step:
            flops.stop()
        if steps == warmup or (steps == 1 and warmup > 1):
            self.clock.sync()  # edge of the measured window; the first step's end, for its mark
        self.marks.append(self.clock.mark())
        if steps == 1:
            mark("first_step")
        if steps == warmup:
            mark("warmup_done")
        if flops is not None and steps == flops.step - 1:
            flops.start()
        if steps >= warmup + self.spec.measure_steps:
            self.clock.sync()
            mark("measured_done")
            self.finish(complete=True)

    # What a framework adapter says of a script that reached no step (the plain torch adapter:
    # what it did reach), written as the result's reason and printed; None for the default reason.
    no_step_reason: Callable[[], str] | None = None

    def _no_step(self) -> None:
        reason = self.no_step_reason() if self.no_step_reason is not None else None
        if reason:
            sys.stderr.write(f"mpadvise: {reason}\n")
        self.writer.write(stage=Stage.NO_STEP, **({"reason": reason} if reason else {}))
        end_trial_process(EXIT_NO_STEP)

    def _at_exit(self) -> None:
        # The script ended by itself before the measured window was full: keep what it measured.
        if self._stepping() and not self._finished and self.writer.data.get("stage") not in (
                Stage.EXCEPTION, Stage.UNSUPPORTED):
            self.finish(complete=False)


def result_payload(window: StepWindow, *, complete: bool) -> dict[str, Any]:
    """The result file's measurements (stage ``done``), from what ``window`` recorded."""
    peak, kind = window._peak_memory()
    losses = [float(v) for v in window.losses]
    underflow, note = window._underflow()
    notes = list(window.notes)
    flops_per_step, flops_basis = (None, None) if window._flops is None else window._flops.result()
    flops_note = StepFlops.note_for(window.spec, window._flops)
    if flops_note is not None:
        notes.append(flops_note)
    return {
        "stage": Stage.DONE,
        "complete": complete,
        "losses": [json_float(v) for v in losses],
        "step_times": window._step_times()[: len(losses)],
        "loss_scale": window.loss_scale,
        "skipped": window.skipped,
        "underflow": underflow,
        "samples": window.samples,
        "warmup_steps": window.spec.warmup_steps,
        "peak_memory": peak,
        "memory_kind": kind,
        "notes": notes if note is None else [*notes, note],
        "workload_fingerprint": window.workload_fingerprint,
        "model_signature": window.model_signature,
        "fsdp": window.fsdp,
        "optimizer_eps": window.optimizer_eps,
        "flops_per_step": flops_per_step,
        "flops_basis": flops_basis,
        **window.batch,
    }
