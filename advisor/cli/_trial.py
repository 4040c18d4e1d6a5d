"""``mpadvise trial``: the fp32 reference against named candidates, shown side by side, with
how far fp32 drifts after one rounding (its replicate, initial parameters perturbed once), which
the verdicts allow for."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
from advisor.trial import parse_memory
from advisor.tune._checks import check_modes, check_script, default_trial_modes
from advisor.tune._options import check_rank_device
from advisor.tune._trials import ScriptRunner, TrialSettings, run_comparison
from policies import Policy
from probes import hardware_fingerprint

EXIT_OK, EXIT_UNSTABLE = 0, 3


def run_trial_command(
    script: Path,
    script_args: list[str],
    *,
    modes: list[str],
    steps: int,
    warmup: int,
    memory_limit: str | None,
    timeout: float,
    seed: int,
    device: str | None,
    framework: str | None = None,
    nproc_per_node: int = 1,
    plot: Path | None,
    json_output: bool,
    console: Console,
) -> int:
    """Run the comparison and print it. Returns 0 when every candidate is stable, else 3."""

    path = check_script(script)
    check_rank_device(nproc_per_node, device)  # before the device is looked up
    profile = probes.profile_for(device)
    plan = plan_for(path, framework, device=profile.device)
    if modes:
        modes = check_plan_modes(plan, check_modes(modes, profile))
    else:  # every mode the hardware supports that the script's framework can apply
        modes = [m for m in default_trial_modes(profile) if plan.limits is None or plan.limits.modes is None
                 or m in plan.limits.modes]
    modes = [m for m in modes if m != "fp32"]
    settings = TrialSettings(
        warmup_steps=warmup, measure_steps=steps, seed=seed, timeout=timeout, device=device,
        memory_limit=parse_memory(memory_limit) if memory_limit else None, framework=plan.framework,
        nproc_per_node=nproc_per_node,
    )
    runner = ScriptRunner(path, script_args, settings, launch=plan.launch)
    candidates = [(Policy(mode=m), m) for m in modes]
    progress_console = Console(stderr=True) if json_output else console
    # The reference, its perturbed replicate, then each candidate.
    with trial_progress(progress_console, len(candidates) + 2, enabled=sys.stderr.isatty() or not json_output) as (start, done):
        comparison = run_comparison(runner, candidates, on_start=start, on_done=done)
    reference, evaluations, replicate = comparison.reference, comparison.evaluations, comparison.replicate
    steps = comparison.measure_steps or steps
    if plot is not None:
        plot_trials(str(plot), reference, evaluations)
    if json_output:
        payload = {
            "script": str(path),
            "args": script_args,
            "framework": plan.framework,
            "hardware": {"name": profile.name, "fingerprint": hardware_fingerprint(profile), "device": settings.device or profile.device},
            "settings": {"warmup_steps": warmup, "measure_steps": steps, "seed": seed, "memory_limit": settings.memory_limit,
                         "nproc_per_node": nproc_per_node},
            "window_note": comparison.window_note,
            "reference": reference.to_dict(),
            "replicate": None if replicate is None else replicate.to_dict(),
            "candidates": [ev.to_dict() for ev in evaluations],
            "plot": str(plot) if plot else None,
        }
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        title = f"{path.name} on {profile.name}: {warmup} warm-up + {steps} measured steps per trial, seed {seed}"
        console.print(evaluation_table(reference, evaluations, title=title))
        if comparison.window_note:
            console.print(f"window: {comparison.window_note}", highlight=False)
        console.print(spread_line(reference.to_dict(), None if replicate is None else replicate.to_dict(losses=False)),
                      highlight=False)
        print_reasons(console, evaluations)
        if plot is not None:
            console.print(f"plot written to {plot}")
    return EXIT_OK if all(ev.stable for ev in evaluations) else EXIT_UNSTABLE
