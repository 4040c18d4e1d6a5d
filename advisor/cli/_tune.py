"""``mpadvise tune``: search, write the config file, remember the answer, report it; or queue
the same tune with the local daemon (``--submit``) and report it the same way."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

import probes
from advisor._log import get_logger
from advisor._paths import cache_dir, config_path_for
from advisor._secure import (
    ensure_private_dir,
    ensure_private_file,
    open_private_new,
)
from advisor.cache._recommend import record_tune
from advisor.cli._report import render_tune, tune_progress
from advisor.frameworks import ScriptPlan, check_plan_modes, plan_for
from advisor.runtime._workload import script_digest
from advisor.tune._checks import check_modes, check_script
from advisor.tune._engine import TuneResult, tune_policy
from advisor.tune._options import TuneOptions
from advisor.tune._search import check_storage, check_study, shown_url
from advisor.tune._trials import WAIT_IDLE_ENV, ScriptRunner, TrialSettings
from probes import HardwareProfile, MpadviseError, UsageError, hardware_fingerprint

EXIT_FOUND, EXIT_NONE_STABLE = 0, 3


def default_storage() -> str | None:
    """The study database in the cache directory, or ``None`` (in memory) when unusable."""
    directory = cache_dir()
    study = directory / "studies.db"
    try:
        ensure_private_dir(directory)
        ensure_private_file(study)
        probe = directory / f".write-test-{os.getpid()}"
        os.close(open_private_new(probe))
        probe.unlink()
    except MpadviseError as exc:
        get_logger().warning(f"{exc}; the study is kept in memory, so --resume will not work")
        return None
    except OSError as exc:
        get_logger().warning(f"cache directory {directory} is not writable ({exc.strerror or exc}); the study is kept in memory, so --resume will not work")
        return None
    return f"sqlite:///{study}"


def study_name_for(script: Path, args: list[str], fingerprint: str, *, processes: int = 1) -> str:
    """The study a tune of ``script ARGS`` on this hardware joins (see :func:`study_name_from`)."""
    return study_name_from(script.name, script_digest(script), args, fingerprint, processes=processes)


def study_name_from(script_name: str, content_digest: str | None, args: list[str], fingerprint: str, *,
                    processes: int = 1) -> str:
    """The study's name: the script's stem, the hardware fingerprint, and a digest of the
    script's file name, its content, its arguments and (above one) its processes per trial.

    Every worker that tunes the same script with the same arguments on the same hardware joins
    one study, wherever its checkout lies; a changed script, other arguments, other hardware or
    another number of processes (a step of N ranks is another measurement) make another study,
    so measurements that would not compare never share one.
    """
    facts: list[object] = [script_name, content_digest, args, fingerprint]
    if processes > 1:  # one process keeps the name it always had
        facts.append({"nproc_per_node": processes})
    digest = hashlib.sha256(json.dumps(facts).encode()).hexdigest()[:12]
    return f"{Path(script_name).stem}-{fingerprint}-{digest}"


def run_tune_command(script: Path, script_args: list[str], options: TuneOptions, *, json_output: bool,
                     console: Console) -> int:
    """Run the tune here and report it. Returns 0 when a stable policy was found, 3 when none was."""
    path = check_script(script)
    profile = probes.profile_for(options.device)
    plan = plan_for(path, options.framework, device=profile.device)
    check_plan_modes(plan, list(options.modes))
    options = options.with_(framework=plan.framework)
    options = _resolved(options, profile)
    fingerprint = hardware_fingerprint(profile)
    study_name = study_name_for(path, script_args, fingerprint, processes=options.nproc_per_node)
    check_study(options.storage, study_name, hardware=fingerprint, resume=options.resume)
    progress_console = Console(stderr=True) if json_output else console
    if plan.framework is not None:
        how = "read from its imports" if plan.detected else "--framework"
        get_logger().info(f"{path.name} trains with {plan.label} ({how}): the search covers what it can apply")
    result = _search(path, script_args, options, profile, study_name, progress_console, plan)
    written, cache_id = _keep(result, options, profile, path, script_args)
    payload = result.to_dict()
    payload.update(script=str(path), args=script_args, framework=plan.framework, calls_load_policy=calls_load_policy(path),
                   config_file=str(written) if written else None,
                   cache_id=cache_id, storage=shown_url(options.storage), study_name=study_name,
                   hardware={"name": profile.name, "fingerprint": fingerprint})
    _report(json.dumps(payload, indent=2, default=str), json_output=json_output, console=console)
    return EXIT_FOUND if result.policy is not None else EXIT_NONE_STABLE


def calls_load_policy(script: Path) -> bool:
    """Whether the script's source calls ``load_policy`` (``advisor.load_policy()``, or the name
    imported), so that the report does not ask for a line it already has."""
    try:
        tree = ast.parse(script.read_bytes())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name == "load_policy":
                return True
    return False


def _resolved(options: TuneOptions, profile: HardwareProfile) -> TuneOptions:
    """The options with their modes checked on this hardware and the study storage chosen
    (and opened once, so a bad URL fails before any trial runs)."""
    modes = check_modes(list(options.modes), profile) if options.modes else []
    storage = options.storage if options.storage is not None else default_storage()
    check_storage(storage)
    return options.with_(modes=modes, storage=storage)


def _search(path: Path, script_args: list[str], options: TuneOptions, profile: HardwareProfile,
            study_name: str, console: Console, plan: ScriptPlan) -> TuneResult:
    """The tune itself, one subprocess per trial, under a progress bar."""
    # Under the daemon, every trial first waits until no other process computes on the GPU.
    wait_idle_on = profile if os.environ.get(WAIT_IDLE_ENV) else None
    runner = ScriptRunner(path, script_args, TrialSettings.for_tune(options), wait_idle_on=wait_idle_on,
                          launch=plan.launch)
    # The budget plus the reference and its replicate; then each round of re-measurement.
    with tune_progress(console, options.trials + 2) as (on_start, on_done, on_round):
        return tune_policy(runner, profile, options, study_name=study_name, workload={"script": str(path)},
                           on_start=on_start, on_done=on_done, on_round=on_round, limits=plan.limits)


def _keep(result: TuneResult, options: TuneOptions, profile: HardwareProfile,
          path: Path, script_args: list[str]) -> tuple[Path | None, int | None]:
    """Write the winner's config file and cache it; returns the file and the cache entry."""
    if result.policy is None:
        return None, None
    written = result.policy.save(Path(options.out) if options.out is not None else config_path_for(path))
    cache_id = None if options.no_cache else _remember(result, profile, path, script_args)
    return written, cache_id


def _remember(result: TuneResult, profile: Any, script: Path, script_args: list[str]) -> int | None:
    tuned_on = None if result.policy is None else result.policy.tuned_on
    if result.policy is None or tuned_on is None or not tuned_on.workload_fingerprint:
        return None
    speedup = result.speedup.to_dict() if result.speedup else {}
    rows = []
    for number, (cand, m) in enumerate(result.ranking()):
        metrics: dict[str, Any] = {"feasible": m.feasible, "label": cand.label}
        if cand == result.winner:  # the tune's one speed-up figure, with its interval and basis
            metrics.update({f"speedup_{k}": v for k, v in speedup.items()})
        rows.append({
            "number": number, "mode": cand.mode, "params": cand.params(), "outcome": m.outcome or "ok",
            "verdict": "stable" if m.stable else "not stable", "reason": m.reason, "goodput": m.goodput,
            "metrics": metrics,
        })
    return record_tune(
        profile=profile, policy=result.policy, script=str(script), workload_fingerprint=tuned_on.workload_fingerprint,
        trials=rows, speedup_vs_fp32=tuned_on.speedup_vs_fp32, goodput=tuned_on.goodput, args=script_args,
    )


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
    from advisor.daemon._client import DaemonClient, finished_tune, tune_job_body

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
