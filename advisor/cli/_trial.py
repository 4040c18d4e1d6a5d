"""``mpadvise trial``: the fp32 reference against named candidates, shown side by side, with
how far fp32 drifts after one rounding (its replicate, initial parameters perturbed once), which
the verdicts allow for."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

import probes
from advisor.cli._report import (
    evaluation_table,
    plot_trials,
    print_reasons,
    spread_line,
    trial_progress,
)
from advisor.frameworks import check_plan_modes, plan_for
from advisor.tune import (
    Comparison,
    ScriptRunner,
    TrialSettings,
    TuneOptions,
    check_modes,
    check_script,
    default_trial_modes,
    run_comparison,
)
from policies import Policy
from probes import HardwareProfile, hardware_fingerprint

EXIT_OK, EXIT_UNSTABLE = 0, 3


def run_trial_command(
    script: Path,
    script_args: list[str],
    options: TuneOptions,
    *,
    plot: Path | None,
    json_output: bool,
    console: Console,
) -> int:
    """Run the comparison and print it. Returns 0 when every candidate is stable, else 3.

    Of ``options`` (checked already, a multi-process trial's device too), the comparison reads
    its candidates (``modes``; default: every mode the hardware supports that the script's
    framework can apply) and the measuring window of every trial (``steps``, ``warmup``,
    ``memory_limit``, ``timeout``, ``seed``, ``device``, ``framework``, ``nproc_per_node``).
    """
    path = check_script(script)
    profile = probes.profile_for(options.device)
    plan = plan_for(path, options.framework, device=profile.device)
    if options.modes:
        modes = check_plan_modes(plan, check_modes(list(options.modes), profile))
    else:  # every mode the hardware supports that the script's framework can apply
        modes = [m for m in default_trial_modes(profile) if plan.limits is None or plan.limits.modes is None
                 or m in plan.limits.modes]
    modes = [m for m in modes if m != "fp32"]
    settings = TrialSettings.for_tune(options.with_(framework=plan.framework))
    runner = ScriptRunner(path, script_args, settings, launch=plan.launch)
    candidates = [(Policy(mode=m), m) for m in modes]
    progress_console = Console(stderr=True) if json_output else console
    # The reference, its perturbed replicate, then each candidate.
    with trial_progress(progress_console, len(candidates) + 2, enabled=sys.stderr.isatty() or not json_output) as (start, done):
        comparison = run_comparison(runner, candidates, on_start=start, on_done=done)
    if plot is not None:
        plot_trials(str(plot), comparison.reference, comparison.evaluations)
    if json_output:
        payload = _payload(comparison, path, script_args, plan.framework, profile, settings, plot)
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        _render(comparison, path, profile, settings, plot, console)
    return EXIT_OK if all(ev.stable for ev in comparison.evaluations) else EXIT_UNSTABLE


def _payload(comparison: Comparison, path: Path, script_args: list[str], framework: str | None,
             profile: HardwareProfile, settings: TrialSettings, plot: Path | None) -> dict[str, Any]:
    """What ``--json`` prints: the script, the hardware, the window, and each trial's evaluation."""
    replicate = comparison.replicate
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
        "reference": comparison.reference.to_dict(),
        "replicate": None if replicate is None else replicate.to_dict(),
        "candidates": [ev.to_dict() for ev in comparison.evaluations],
        "plot": str(plot) if plot else None,
    }


def _render(comparison: Comparison, path: Path, profile: HardwareProfile, settings: TrialSettings,
            plot: Path | None, console: Console) -> None:
    """The comparison as a table, the window, the run-to-run spread and each verdict's reason."""
    reference, evaluations, replicate = comparison.reference, comparison.evaluations, comparison.replicate
    steps = comparison.measure_steps or settings.measure_steps
    title = (f"{path.name} on {profile.name}: {settings.warmup_steps} warm-up + {steps} measured steps per trial, "
             f"seed {settings.seed}")
    console.print(evaluation_table(reference, evaluations, title=title))
    if comparison.window_note:
        console.print(f"window: {comparison.window_note}", highlight=False)
    console.print(spread_line(reference.to_dict(), None if replicate is None else replicate.to_dict(losses=False)),
                  highlight=False)
    print_reasons(console, evaluations)
    if plot is not None:
        console.print(f"plot written to {plot}")
