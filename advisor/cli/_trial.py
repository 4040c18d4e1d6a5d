"""``mpadvise trial``: the fp32 reference (and its perturbed replicate) against named candidates,
side by side; ``--stream`` keeps every verdict in a file, a JSON line per trial."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

import probes
from advisor._log import get_logger
from advisor.cli._common import bad_value
from advisor.cli._plot import check_matplotlib, plot_trials
from advisor.cli._report import evaluation_table, print_reasons, trial_progress
from advisor.cli._report_cells import print_disturbances, spread_line
from advisor.frameworks import check_plan_modes, plan_for
from advisor.trial import TrialResult
from advisor.tune import (
    Comparison,
    DisturbanceWatch,
    PairedRuns,
    ScriptRunner,
    StabilityThresholds,
    SteadyRunner,
    TrialSettings,
    TuneOptions,
    check_judgeable_window,
    check_modes,
    check_script,
    default_trial_modes,
    pairs_runs,
    prestarted_launcher,
    run_comparison,
    run_pairs,
)
from policies import Policy
from probes import HardwareProfile, MpadviseError, UsageError, hardware_fingerprint

if TYPE_CHECKING:
    from advisor.tune import Evaluation

EXIT_OK, EXIT_UNSTABLE = 0, 3
STREAM_ENV = "MPADVISE_TRIAL_STREAM"


class TrialStream:
    """Appends one JSON line per finished trial to ``path`` (``event``: ``"trial"``, with its
    ``index``, ``role`` and evaluation), then the ``"comparison"`` that ``--json`` prints. The
    file is opened and closed for every line, so a line once written survives a kill."""

    def __init__(self, path: Path | None, *, given_by: str = "--stream") -> None:
        self.path = path
        self.given_by = given_by

    def check_writable(self) -> None:
        """Create the file (keeping what it holds) before any trial runs; a bad environment
        variable is not a usage error, a bad ``--stream`` is."""
        if self.path is None:
            return
        try:
            self.path.open("a", encoding="utf-8").close()
        except OSError as exc:
            why = f"cannot write there ({exc.strerror or exc}); name a file in a writable directory"
            if self.given_by == STREAM_ENV:
                raise MpadviseError(f"{STREAM_ENV}={self.path}: {why}, or unset it") from None
            raise UsageError(f"{self.given_by} {self.path}: {why}") from None

    def trial(self, index: int, evaluation: Evaluation, role: str | None = None) -> None:
        """One finished trial; its role, unless given (``"pair"``), read from its index and mode."""
        role = role or ("reference" if index == 0 else "replicate" if evaluation.policy.mode == "fp32" else "candidate")
        self._append({"event": "trial", "index": index, "role": role, **evaluation.to_dict(),
                      **trial_breakdown(evaluation.result)})

    def comparison(self, payload: dict[str, Any]) -> None:
        self._append({"event": "comparison", **payload})

    def _append(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            with self.path.open("a", encoding="utf-8") as stream:
                stream.write(json.dumps(record, default=str) + "\n")


def run_trial_command(script: Path, script_args: list[str], options: TuneOptions, *, plot: Path | None,
                      json_output: bool, console: Console, stream: TrialStream | None = None, quiet: bool = False,
                      pairs: int = 0) -> int:
    """Run the comparison and print it; 0 when every candidate is stable (in every round of
    ``pairs`` too), else 3. ``stream`` defaults to the file ``MPADVISE_TRIAL_STREAM`` names."""
    if quiet:
        get_logger().setLevel(logging.WARNING)
    path = check_script(script)
    if plot is not None:  # drawn after every trial: a path it cannot take is refused before the first
        with bad_value():  # a bad --plot value; matplotlib missing (below) is not one
            probes.check_writable(plot, "plot")
        check_matplotlib()
    try:  # a trial may be short, for its speeds alone; say so before it runs, not after
        check_judgeable_window(options)
    except UsageError as exc:
        get_logger().warning(f"{exc}; until then every candidate is too-short: its speed is measured, its "
                             "stability is not judged")
    # The trials' warm server imports while this process imports torch and probes.
    with prestarted_launcher(path, script_args, plan_for(path, options.framework).launch,
                             nproc_per_node=options.nproc_per_node) as warm:
        profile = probes.profile_for(options.device)
        plan = plan_for(path, options.framework, device=profile.device)
        if options.modes:
            modes = check_plan_modes(plan, check_modes(list(options.modes), profile))
        else:  # every mode the hardware supports that the script's framework can apply
            modes = [m for m in default_trial_modes(profile)
                     if plan.limits is None or plan.limits.modes is None or m in plan.limits.modes]
        candidates = [(Policy(mode=m), m) for m in modes if m != "fp32"]
        # Every trial counts one warm-up step's FLOPs (so all run alike): the reference's count is
        # the work each trial's step does, and its TFLOP/s is that over the trial's median step.
        settings = TrialSettings.for_tune(options.with_(framework=plan.framework))
        settings = dataclasses.replace(settings, count_flops=True)
        # Like a tune's, every trial is run again when the machine disturbed or lost it.
        watch = DisturbanceWatch(profile=profile)
        launcher = ScriptRunner(path, script_args, settings, launch=plan.launch, warm=warm)
        runner = SteadyRunner(launcher, watch)
        if stream is None:  # the file MPADVISE_TRIAL_STREAM names, or none
            named = os.environ.get(STREAM_ENV, "").strip()
            stream = TrialStream(Path(named) if named else None, given_by=STREAM_ENV)
        stream.check_writable()
        bar = not quiet and (sys.stderr.isatty() or not json_output)
        paired: list[PairedRuns] = []
        try:
            # The reference, its perturbed replicate, then each candidate.
            first = len(candidates) + 2
            with trial_progress(console, first, enabled=bar, then=stream.trial) as (start, done):
                comparison = run_comparison(runner, candidates, on_start=start, on_done=done)
            runs = pairs_runs(comparison, pairs)
            if runs:  # none without a stable candidate to pair
                def then(i: int, ev: Evaluation) -> None:  # each run streams as a trial of its own
                    stream.trial(first + i, ev, role="pair")

                with trial_progress(console, runs, enabled=bar, then=then) as (start, done):
                    paired = run_pairs(runner, comparison, pairs, on_start=start, on_done=done)
        finally:
            # Ends the runner's warm server; a stand-in may hold none.
            if (close := getattr(runner, "close", None)) is not None:
                close()
        advice = _timeout_advice(comparison, settings)
        if plot is not None:
            replicate = None if comparison.replicate is None else comparison.replicate.curve
            plot_trials(str(plot), comparison.reference, comparison.evaluations,
                        replicate=replicate, advice=advice,
                        judged_against=comparison.judged_against())
        payload = _payload(comparison, path, script_args, plan.framework, profile, settings, plot,
                           advice)
        payload["pairs"] = ({"rounds": pairs, "candidates": [p.to_dict() for p in paired]}
                            if pairs else None)
        payload["disturbed"] = [event.to_dict() for event in watch.events]
        stream.comparison(payload)
        if json_output:
            sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
        else:
            _render(comparison, path, profile, settings, plot, advice, console)
            if pairs:
                _render_pairs(paired, pairs, console)
            print_disturbances(console, payload["disturbed"])
        stable = all(ev.stable for ev in comparison.evaluations)
        return EXIT_OK if stable and not any(p.dropped for p in paired) else EXIT_UNSTABLE


def _render_pairs(paired: list[PairedRuns], rounds: int, console: Console) -> None:
    if not paired:
        console.print(f"--pairs {rounds}: no candidate was stable with a speed to pair", highlight=False)
        return
    console.print(f"Paired with fp32 over {rounds} interleaved round{'s' if rounds > 1 else ''}:", highlight=False)
    for p in paired:
        speedup = p.speedup()
        if speedup is None:
            text = "no round paired it with fp32 (fp32 failed, or they ran on different thread counts)"
        elif speedup.low is None or speedup.high is None:
            text = f"{speedup.ratio:.2f}x fp32 ({speedup.basis}; an interval needs two pairs)"
        else:
            text = (f"{speedup.ratio:.2f}x fp32, {speedup.confidence:.0%} interval {speedup.low:.2f}x-"
                    f"{speedup.high:.2f}x ({speedup.basis})")
        if p.dropped:
            text += f"; [red]left the rounds[/]: {p.dropped}"
        console.print(f"  {p.label}: {text}", highlight=False)


def _payload(comparison: Comparison, path: Path, script_args: list[str], framework: str | None,
             profile: HardwareProfile, settings: TrialSettings, plot: Path | None,
             advice: dict[str, str]) -> dict[str, Any]:
    replicate = comparison.replicate
    flops = comparison.reference.result.flops_per_step
    replicate_dict = None if replicate is None else replicate.to_dict()
    if replicate_dict is not None and replicate.result is not None:
        replicate_dict.update(trial_breakdown(replicate.result, flops))
    return {
        "script": str(path),
        "args": script_args,
        "framework": framework,
        "hardware": {"name": profile.name, "fingerprint": hardware_fingerprint(profile),
                     "device": settings.device or profile.device},
        "settings": {"warmup_steps": settings.warmup_steps, "measure_steps": comparison.measure_steps or settings.measure_steps,
                     "seed": settings.seed, "memory_limit": settings.memory_limit,
                     "nproc_per_node": settings.nproc_per_node},
        "window_note": comparison.window_note,
        "reference": {**comparison.reference.to_dict(),
                      **trial_breakdown(comparison.reference.result, flops)},
        "replicate": replicate_dict,
        "second_replicate": None if comparison.second_replicate is None else comparison.second_replicate.to_dict(),
        "candidates": [{**ev.to_dict(), **trial_breakdown(ev.result, flops),
                        **({"advice": advice[ev.label]} if ev.label in advice else {})}
                       for ev in comparison.evaluations],
        "plot": str(plot) if plot else None,
    }


def _render(comparison: Comparison, path: Path, profile: HardwareProfile, settings: TrialSettings,
            plot: Path | None, advice: dict[str, str], console: Console) -> None:
    reference, evaluations, replicate = comparison.reference, comparison.evaluations, comparison.replicate
    steps = comparison.measure_steps or settings.measure_steps
    title = (f"{path.name} on {profile.name}: {settings.warmup_steps} warm-up + {steps} measured steps per trial, "
             f"seed {settings.seed}")
    console.print(evaluation_table(reference, evaluations, title=title))
    if comparison.window_note:
        console.print(f"window: {comparison.window_note}", highlight=False)
    console.print(spread_line(reference.to_dict(), None if replicate is None else replicate.to_dict(losses=False)),
                  highlight=False)
    if comparison.second_replicate is not None:
        console.print(f"{comparison.second_replicate.label}: run because a candidate fell just short of the limits "
                      "the first set (its reason says against which it was judged)", highlight=False)
    print_reasons(console, evaluations)
    for label, text in advice.items():
        console.print(f"[red]{label}[/]: {text}", highlight=False)
    rows = [("fp32", reference.result)]
    if replicate is not None and replicate.result is not None:
        rows.append(("fp32 replicate", replicate.result))
    rows += [(ev.label, ev.result) for ev in evaluations]
    console.print(breakdown_table(rows, reference.result.flops_per_step))
    legend = ("start-up: launch to torch imported; set-up: the script's own, to the candidate's application; "
              "1st step: to the end of the first optimizer step; warm-up and measured: the trial's two windows; "
              "exit: to the process's end.")
    if reference.result.flops_per_step:
        legend += (f" TFLOP/s: fp32's {reference.result.flops_per_step:.3g} FLOPs per optimizer step "
                   f"({reference.result.flops_basis}) over each trial's median measured step.")
    console.print(legend, highlight=False)
    if plot is not None:
        console.print(f"plot written to {plot}")


def _timeout_advice(comparison: Comparison, settings: TrialSettings) -> dict[str, str]:
    """By label, for each candidate killed by the time limit: that this is no verdict, and what to change."""
    steps = comparison.measure_steps or settings.measure_steps
    fewer = max(StabilityThresholds().min_steps, steps // 2)
    advice = {}
    for ev in comparison.evaluations:
        if ev.result.outcome != "timeout":
            continue
        text = (f"{ev.label} timed out, which is not a stability verdict: the trial was killed after "
                f"{settings.timeout:g} s; give it more time with --timeout {2 * settings.timeout:g}")
        if fewer < steps:
            text += f", or measure fewer steps with --steps {fewer} (now {steps})"
        advice[ev.label] = text
    return advice


# The columns of the per-trial breakdown: a phase of advisor.trial.PHASES and its heading.
_PHASE_COLUMNS = (("startup", "start-up"), ("script_setup", "set-up"), ("to_first_step", "1st step"),
                  ("warmup", "warm-up"), ("measured", "measured"), ("exit", "exit"))


def achieved_tflops(result: TrialResult, flops_per_step: float | None) -> float | None:
    """The reference's FLOPs per step (the same work in every trial) over the trial's median
    measured step, in TFLOP/s; ``None`` where either is unknown."""
    measured = [t for t in result.step_times[result.warmup_steps:] if t > 0]
    if not flops_per_step or not measured:
        return None
    return flops_per_step / statistics.median(measured) / 1e12


def trial_breakdown(result: TrialResult, reference_flops: float | None = None) -> dict[str, Any]:
    """What ``--json`` and ``--stream`` add to each trial: timeline, phases, FLOPs, TFLOP/s."""
    data: dict[str, Any] = {"timeline": dict(result.timeline), "phases": result.phases,
                            "flops_per_step": result.flops_per_step, "flops_basis": result.flops_basis}
    if reference_flops is not None:
        data["achieved_tflops"] = achieved_tflops(result, reference_flops)
    return data


def breakdown_table(rows: list[tuple[str, TrialResult]], reference_flops: float | None) -> Table:
    # No box and one space either side of a cell: seven numeric columns and a label fit in 80.
    table = Table(title="Where each trial's time went (seconds)", title_justify="left", box=None,
                  pad_edge=False, padding=(0, 1), header_style="bold")
    table.add_column("trial", overflow="fold", min_width=11, ratio=1)
    for _, heading in _PHASE_COLUMNS:
        table.add_column(heading, justify="right", no_wrap=True)
    if reference_flops:
        table.add_column("TFLOP/s", justify="right", no_wrap=True)
    for label, result in rows:
        phases = result.phases
        cells = [label, *(_seconds_text(phases.get(name)) for name, _ in _PHASE_COLUMNS)]
        if reference_flops:
            cells.append(_tflops_text(achieved_tflops(result, reference_flops)))
        table.add_row(*cells)
    return table


def _seconds_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def _tflops_text(value: float | None) -> str:
    if value is None:
        return "-"
    if value < 0.01:
        return f"{value:.1e}"  # a small model on a CPU: seven characters at most
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"
