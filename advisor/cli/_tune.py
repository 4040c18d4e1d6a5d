"""``mpadvise tune``: search, write the config file, remember the answer, report it; or queue
the same tune with the local daemon (``--submit``) and report it the same way."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from rich.console import Console

import probes
from advisor.cli._report import render_tune, tune_progress
from advisor.frameworks import check_plan_modes, plan_for
from advisor.tune import (
    ScriptLaunch,
    TuneOptions,
    TuneRequest,
    check_script,
    resolve_storage,
    tune_script,
)
from probes import UsageError

__all__ = ["run_tune_command", "submit_tune_command"]


def run_tune_command(script: Path, script_args: list[str], options: TuneOptions, *, json_output: bool,
                     console: Console) -> int:
    """Run the tune here and report it. Returns 0 when a stable policy was found, 3 when none was."""
    # The URL may come from the environment instead, to keep its password out of ps.
    options = options.with_(storage=resolve_storage(options.storage, os.environ))
    path = check_script(script)
    profile = probes.profile_for(options.device)
    plan = plan_for(path, options.framework, device=profile.device)
    check_plan_modes(plan, list(options.modes))
    request = TuneRequest(path, tuple(script_args), options, ScriptLaunch.of(plan))
    progress_console = Console(stderr=True) if json_output else console
    done = tune_script(request, profile=profile, progress=lambda total: tune_progress(progress_console, total))
    _report(json.dumps(done.to_dict(), indent=2, default=str), json_output=json_output, console=console)
    return done.exit_code


def _report(tune_json: str, *, json_output: bool, console: Console) -> None:
    """Print a tune's JSON as is (``--json``), or its summary rendered from that same JSON."""
    if json_output:
        sys.stdout.write(tune_json + "\n")
    else:
        render_tune(json.loads(tune_json), console)


def submit_tune_command(script: Path, script_args: list[str], options: TuneOptions, *, json_output: bool,
                        console: Console, poll_s: float = 1.0) -> int:
    """Queue the tune with the local daemon, follow its lines, and report it as a local tune.

    Returns:
        The tune's exit code: 0 when a stable policy was found, 3 when none was.

    Raises:
        MpadviseError: no daemon, the job was refused (exit 2), failed, was cancelled or interrupted.
    """
    from advisor.daemon import DaemonClient, finished_tune, tune_job_body

    if options.storage is not None:
        raise UsageError("--storage cannot be used with --submit: the daemon keeps its studies in its cache directory")
    if options.nproc_per_node > 1:
        raise UsageError(f"--nproc-per-node {options.nproc_per_node} cannot be used with --submit: the daemon gives "
                         "each job one GPU; run the tune here instead")
    body = tune_job_body(script, script_args, options)
    client = DaemonClient.local(need_token=True)
    err = Console(stderr=True) if json_output else console
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
                            on_waiting=lambda message: err.print(message, highlight=False), poll_s=poll_s)
    except KeyboardInterrupt:
        client.cancel(job["id"])
        err.print(f"cancelled job {job['id']}", highlight=False)
        raise
    tune, code = finished_tune(job)
    _report(json.dumps(tune, indent=2, default=str), json_output=json_output, console=console)
    return code
