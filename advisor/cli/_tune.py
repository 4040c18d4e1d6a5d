"""``mpadvise tune``: search, write the config file, remember the answer, report it; or queue
the same tune with the local daemon (``--submit``) and report it the same way."""

from __future__ import annotations

import functools
import json
import logging
import os
import shlex
from contextlib import nullcontext
from pathlib import Path

from rich.console import Console

import probes
from advisor._log import get_logger
from advisor.cli._common import err_console, fail, print_json
from advisor.cli._report import render_tune, tune_progress
from advisor.frameworks import check_plan_modes, plan_for
from advisor.tune import (
    ScriptLaunch,
    TuneOptions,
    TuneRequest,
    check_script,
    default_storage,
    finished_trials,
    prestarted_launcher,
    resolve_storage,
    shown_url,
    study_name_for,
    tune_plan,
    tune_script,
)
from probes import UsageError, hardware_fingerprint


def run_tune_command(script: Path, script_args: list[str], options: TuneOptions, *, json_output: bool,
                     console: Console, quiet: bool = False, dry_run: bool = False, verbose: bool = False) -> int:
    """Run the tune here and report it: 0 when a stable policy was found, 3 when none was;
    ``dry_run`` only shows the search space and the plan."""
    given = options
    # The URL may come from the environment instead, to keep its password out of ps.
    options = options.with_(storage=resolve_storage(options.storage, os.environ))
    path = check_script(script)
    # The trials' warm server imports while this process imports torch and probes.
    launch = plan_for(path, options.framework).launch
    warm = None if dry_run else prestarted_launcher(path, script_args, launch,
                                                    nproc_per_node=options.nproc_per_node)
    with warm or nullcontext():
        profile = probes.profile_for(options.device)
        plan = plan_for(path, options.framework, device=profile.device)
        check_plan_modes(plan, list(options.modes))
        if dry_run:
            planned = tune_plan(TuneRequest(path, tuple(script_args), options, ScriptLaunch.of(plan)), profile)
            print_json(planned) if json_output else _render_plan(planned, console)
            return 0
        if options.storage is None:  # chosen here, as the tune would, so the study can be named before it runs
            options = options.with_(storage=default_storage())
        study_name = study_name_for(path, list(script_args), hardware_fingerprint(profile),
                                    processes=options.nproc_per_node)
        flags = (*(["--json"] if json_output else []), *(["--quiet"] if quiet else []))
        resume = resume_command(script, script_args, given, flags)
        request = TuneRequest(path, tuple(script_args), options, ScriptLaunch.of(plan))
        if quiet:
            get_logger().setLevel(logging.WARNING)
        try:
            progress = None if quiet else functools.partial(tune_progress, console)
            done = tune_script(request, profile=profile, warm=warm, progress=progress)
        except KeyboardInterrupt:  # say what Ctrl-C kept, and how to continue
            if options.storage is None:
                raise fail(f"interrupted; study {study_name!r} was kept in memory, so nothing can "
                           "be resumed: run the tune again to start over", 130) from None
            finished = finished_trials(options.storage, study_name)
            stop = fail(f"interrupted; {finished} finished trial{'' if finished == 1 else 's'} "
                        f"kept in study {study_name!r} in {shown_url(options.storage)!r}", 130)
            err_console.print(f"continue with: {resume}", highlight=False, markup=False,
                              soft_wrap=True)
            raise stop from None
    if json_output:
        print_json(done.to_dict())
    else:  # the continue line is this command as typed: the tune's JSON does not hold its options
        shown = {**json.loads(json.dumps(done.to_dict(), default=str)), "resume_command": resume}
        render_tune(shown, console, verbose=verbose, already_tuned=done.already_tuned)
    return done.exit_code


def _render_plan(planned: dict, console: Console) -> None:
    space, plan = planned["space"], planned["plan"]
    line = functools.partial(console.print, highlight=False, markup=False, soft_wrap=True)
    line(f"dry run: nothing runs, nothing is written ({planned['hardware']['name']})")
    line("search space")
    line(f"  modes: {', '.join(space['modes'])}")
    for mode, why in space["excluded"].items():
        line(f"  not {mode}: {why}")
    line(f"  micro-batch: {space['micro_batch']}")
    scale = space["loss_scale"]
    if scale["modes"]:
        line(f"  loss scaling ({', '.join(scale['modes'])}): {' or '.join(scale['kinds'])}; initial scale "
             f"{', '.join(f'{s:g}' for s in scale['init_scales'])}; growth interval "
             f"{', '.join(map(str, scale['growth_intervals']))} (dynamic)")
    else:
        line("  loss scaling: none (no mode searched scales its loss)")
    line(f"  candidates: at most {space['candidates']}")
    line("plan")
    how = "read from its imports" if plan["framework_detected"] else "--framework" if plan["framework"] else "default"
    line(f"  trains with: {plan['trains_with']} ({how})")
    per = f", {plan['processes_per_trial']} processes per trial (one per rank)" if plan["processes_per_trial"] > 1 else ""
    line(f"  launch: {shlex.join(plan['launch'])}{per}")
    budget = "none" if plan["time_budget_s"] is None else f"{plan['time_budget_s']:g} s"
    line(f"  trials: {plan['trials']} (and the fp32 reference twice), {plan['steps']} measured steps after "
         f"{plan['warmup']} warm-up; time budget: {budget}; each trial killed after {plan['trial_timeout_s']:g} s")
    line(f"  config file: {plan['config_file']}")
    line(f"  cache: {'the answer is cached for this GPU' if plan['cache'] else 'not cached (--no-cache)'}")
    line(f"  study: {plan['study_name']} in {plan['storage']}: {plan['study_action']}")


def resume_command(script: Path, script_args: list[str], options: TuneOptions, flags: tuple[str, ...] = ()) -> str:
    """This tune's command line as given (``flags``: its own, such as ``--json``), with
    ``--resume``; a storage URL's password masked (one from the environment stays there)."""
    options = options.with_(resume=True, fresh=False)
    argv = [shown_url(arg) or arg if arg == options.storage else arg for arg in options.to_argv()]
    # Always the installed name, however this process was started: a command to paste never
    # carries an interpreter's path.
    tail = ["--", *script_args] if script_args else []
    return shlex.join(["mpadvise", "tune", str(script), *argv, *flags, *tail])


def submit_tune_command(script: Path, script_args: list[str], options: TuneOptions, *, json_output: bool,
                        console: Console, quiet: bool = False, verbose: bool = False) -> int:
    """Queue the tune with the local daemon, follow it, and report it as a local tune."""
    from advisor.daemon import DaemonClient, finished_tune, tune_job_body

    if options.storage is not None:
        raise UsageError("--storage cannot be used with --submit: the daemon keeps its studies in its cache directory")
    if options.nproc_per_node > 1:
        raise UsageError(f"--nproc-per-node {options.nproc_per_node} cannot be used with --submit: the daemon gives "
                         "each job one GPU; run the tune here instead")
    body = tune_job_body(script, script_args, options)
    client = DaemonClient.local(need_token=True)
    err = Console(stderr=True, quiet=quiet) if json_output or quiet else console
    # Run where a local tune would, in this directory, when the daemon allows it there;
    # otherwise the daemon runs the job in the script's directory.
    cwd = Path(os.path.realpath(os.getcwd()))
    if client.allows(cwd):
        body["cwd"] = str(cwd)
    else:
        err.print(f"note: the job runs in {Path(body['script']).parent} (the daemon does not allow {cwd})", highlight=False)
    job = client.submit(body)
    err.print(f"queued job {job['id']} with the daemon at {client.where}", highlight=False)
    try:
        job = client.follow(job, on_line=lambda line: err.print(line, highlight=False, markup=False),
                            on_waiting=lambda message: err.print(message, highlight=False))
    except KeyboardInterrupt:
        client.cancel(job["id"])
        err.print(f"cancelled job {job['id']}", highlight=False)
        raise
    tune, code = finished_tune(job)
    print_json(tune) if json_output else render_tune(tune, console, verbose=verbose)
    return code
