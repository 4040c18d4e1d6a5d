"""What a tune job runs: its request, its command line and environment, and whether its paths
may run under the daemon's roots."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from advisor._entry import module_argv
from advisor.daemon._config import JOB_ENV, under_roots
from advisor.frameworks import check_plan_modes, plan_for
from advisor.tune import WAIT_IDLE_ENV, ScriptLaunch, TuneOptions, TuneRequest, resolve_storage

PathKind = Literal["file", "dir", "new"]  # an existing file, an existing directory, a new file

def tune_argv(request: str | os.PathLike[str], result: str | os.PathLike[str], *, python: str = sys.executable) -> list[str]:
    """``python -m advisor.tune.job REQUEST.json RESULT.json``, without the working directory on
    ``sys.path``; the script's arguments travel in the request file, never on this line."""
    return [python, *module_argv("advisor.tune.job"), os.fspath(request), os.fspath(result)]


def job_request(job: Mapping[str, Any], slot: str) -> tuple[TuneRequest, str]:
    """The tune a stored job asks for on ``slot``, and the directory it runs in (its own, else
    the script's).

    The script's plan is made here, as ``mpadvise tune`` makes it. Raises MpadviseError for
    stored options out of bounds, an unreadable script, an unknown framework or mode, or an
    unusable storage setting.
    """
    stored = dict(job.get("options") or {})
    cwd = stored.pop("cwd", None) or os.path.dirname(job["script"])  # kept beside the options
    options = TuneOptions.from_dict(stored).with_(device=slot)  # the slot, whatever the job said
    # A study's URL (with its password) comes from the daemon's own environment, as
    # `mpadvise tune` takes it from the user's: it travels in the private request file, never
    # in a job's arguments, which every user of the machine can read in `ps`.
    options = options.with_(storage=resolve_storage(None, os.environ))
    if job.get("attempts") and not options.fresh:
        # A job run again (its daemon stopped mid-tune) continues its own study: the finished
        # trials there are this job's, and a tune without --resume refuses to delete them.
        options = options.with_(resume=True)
    script = Path(job["script"])
    plan = plan_for(script, options.framework, device=slot)
    check_plan_modes(plan, list(options.modes))
    return TuneRequest(script, tuple(job.get("args") or ()), options, ScriptLaunch.of(plan)), cwd


def path_refusal(what: str, raw: Any, roots: Sequence[Path], want: PathKind) -> tuple[int, str] | None:
    """Why a job's path may not be used under ``roots``: an HTTP status and one line; or ``None``.

    The one rule, at submission and again when a job is claimed: an absolute path whose real
    path lies under an allowed root (else 403), and is what ``want`` says (else 422).
    """
    if not isinstance(raw, str) or not os.path.isabs(raw):
        return 422, f"{what} {raw!r} is not absolute; send the full path (the daemon's working directory is not yours)"
    try:
        path = Path(os.path.realpath(raw))
    except (OSError, ValueError) as exc:
        return 422, f"{what} {raw!r} cannot be resolved ({exc})"
    if not under_roots(path, roots):
        return 403, (f"{what} {raw!r} is outside the allowed roots ({', '.join(map(str, roots))}); "
                     "move it under one, or start the daemon with --allowed-root")
    try:
        if want == "file" and not path.is_file():
            return 422, f"{what} {raw!r} does not exist or is not a file"
        if want == "dir" and not path.is_dir():
            return 422, f"{what} {raw!r} does not exist or is not a directory"
        if want == "new" and not path.parent.is_dir():
            return 422, f"{what} {raw!r}: its directory does not exist"
    except OSError as exc:
        return 422, f"{what} {raw!r} cannot be read ({exc.strerror or exc})"
    return None


def outside_roots(job: Mapping[str, Any], roots: Sequence[Path]) -> str | None:
    """Why a queued job (its script, and its ``cwd`` and ``--out`` if any) may not run under
    ``roots``, or ``None`` when it may."""
    options = job.get("options") or {}
    checks: list[tuple[str, Any, PathKind]] = [("script", job.get("script"), "file"), ("cwd", options.get("cwd"), "dir"),
                                               ("options.out", options.get("out"), "new")]
    for what, raw, want in checks:
        if raw is None and what != "script":
            continue
        problem = path_refusal(what, raw, roots, want)
        if problem is not None:
            return problem[1]
    return None


def job_env(job_id: str, tmp: Path | None = None) -> dict[str, str]:
    """The environment of a job's process: the daemon's, marked with the job (so that every
    process of it can be found), waiting for an idle GPU before each trial, with ``tmp`` as its
    private temporary directory.

    The daemon's environment is inherited on purpose: a secret set there (a study's
    ``MPADVISE_STORAGE`` URL, an API key) reaches the job without appearing in its arguments,
    which every user of the machine can read in ``ps``.
    """
    env = dict(os.environ)
    env[JOB_ENV] = job_id
    if tmp is not None:
        env["TMPDIR"] = env["TMP"] = env["TEMP"] = str(tmp)
    env[WAIT_IDLE_ENV] = "1"  # and before every trial, not only before the tune starts
    env.pop("MPADVISE_POLICY", None)
    return env
