"""``mpadvise daemon run|start|stop|status``: the local service, from the command line.
``start`` runs ``run`` detached, its output in ``daemon.log``, and returns once ``/health``
answers; FastAPI and uvicorn are imported only by ``run`` and ``start``."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Column, Table

from advisor._secure import ensure_private_dir, ensure_private_file
from advisor.cli._common import JsonOption, console, emit, err_console, handle_errors, print_json
from advisor.daemon import DAEMON_LOGS_KEPT, MAX_DAEMON_LOG_BYTES
from probes import MpadviseError, UsageError

HostOption = Annotated[str, typer.Option("--host", help="Address to serve on; anything but loopback needs --allow-remote.")]
PortOption = Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port; 0 picks a free one (daemon.json says which).")]
UdsOption = Annotated[Path | None, typer.Option("--uds", help="Serve on this Unix socket (mode 0600) instead of TCP.")]
RemoteOption = Annotated[bool, typer.Option(
    "--allow-remote", help="Allow a non-loopback --host. Anyone with the token can then run scripts here.")]
RootOption = Annotated[list[Path] | None, typer.Option(
    "--allowed-root", help="Jobs' scripts must be under this directory; repeat for several. Default: your home.")]
RetentionOption = Annotated[float, typer.Option(
    "--job-retention-days", min=0, envvar="MPADVISE_JOB_RETENTION_DAYS",
    help="Delete finished jobs (rows and logs) this many days after they finished; queued and running ones are kept.")]


def run(
    host: HostOption = "127.0.0.1",
    port: PortOption = 8757,
    uds: UdsOption = None,
    allow_remote: RemoteOption = False,
    allowed_root: RootOption = None,
    job_retention_days: RetentionOption = 30.0,
) -> None:
    """Serve in the foreground until Ctrl-C or SIGTERM (logs on stderr)."""
    from advisor.daemon import DaemonConfig, serve

    check_uds(uds)
    serve(DaemonConfig(host=host, port=port, uds=uds.absolute() if uds else None, allow_remote=allow_remote,
                       allowed_roots=tuple(p.absolute() for p in allowed_root or ()),
                       job_retention_days=job_retention_days))


def start(
    host: HostOption = "127.0.0.1",
    port: PortOption = 8757,
    uds: UdsOption = None,
    allow_remote: RemoteOption = False,
    allowed_root: RootOption = None,
    job_retention_days: RetentionOption = 30.0,
    wait: Annotated[float, typer.Option("--wait", min=1, help="Seconds to wait for the daemon to answer.")] = 60.0,
    json_output: JsonOption = False,
) -> None:
    """Start the daemon in the background (pid and log files in the cache directory)."""
    from advisor.daemon import DaemonClient, DaemonPaths, check_bind, daemon_running

    # Refuse here, in the user's terminal, rather than in a log file they may not read.
    check_uds(uds)
    warning = None if uds is not None else check_bind(host, allow_remote=allow_remote)
    paths = DaemonPaths(DaemonPaths.here().directory.absolute())
    directory = paths.directory
    ensure_private_dir(directory)
    if daemon_running(paths):
        where = paths.read_address().get("url", "?")
        raise MpadviseError(f"a daemon is already running for {directory} at {where}; "
                            "`mpadvise daemon stop` stops it, `mpadvise daemon status` shows it")
    roots = [arg for root in allowed_root or [] for arg in ("--allowed-root", str(root.absolute()))]
    argv = [sys.executable, "-m", "advisor.cli", "daemon", "run", "--host", host,
            "--port", str(port), *(["--uds", str(uds.absolute())] if uds is not None else []),
            *(["--allow-remote"] if allow_remote else []), *roots,
            "--job-retention-days", repr(float(job_retention_days))]
    # The daemon runs from / (it must not keep a directory busy), so a relative cache
    # directory has to be made absolute for it.
    env = {**os.environ, "MPADVISE_HOME": str(directory)}
    ensure_private_file(paths.log)  # refuses a planted symlink or another user's file
    rotate_log(paths.log)
    fd = os.open(paths.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "ab") as log:
        log.write(f"--- mpadvise daemon start {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        log.flush()
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env, cwd="/",
                                   start_new_session=True)
    deadline = time.monotonic() + wait
    while True:
        code = process.poll()
        if code is not None:
            raise MpadviseError(f"the daemon exited at start (code {code}): {_last_log_line(paths.log)} "
                                f"(log: {paths.log})", exit_code=code if code == 2 else 1)
        address = paths.read_address()
        if address.get("pid") == process.pid:
            with contextlib.suppress(MpadviseError):
                # A wildcard bind is reached through the loopback.
                DaemonClient.for_address(address).health()
                break
        if time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGTERM)
            raise MpadviseError(f"the daemon did not answer within {wait:g} s; see {paths.log}")
        time.sleep(0.1)
    if warning:
        err_console.print(f"[bold yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    emit({**address, "warning": warning}, json_output, _render_started)


def _render_started(info: dict[str, Any], console: Console) -> None:
    console.print(f"mpadvise daemon started (pid {info['pid']}) on {info['url']}\n"
                  f"jobs run on: {', '.join(info.get('slots') or [])}; scripts allowed under: "
                  f"{', '.join(info.get('roots') or [])}\n"
                  f"token: {info['token_file']}; log: {info['log']}; "
                  "stop it with `mpadvise daemon stop`", highlight=False)


def stop(
    wait: Annotated[float, typer.Option("--wait", min=1, help="Seconds to wait for it to exit.")] = 30.0,
    json_output: JsonOption = False,
) -> None:
    """Stop the background daemon (SIGTERM); a running job is queued again at the next start."""
    from advisor.daemon import DaemonPaths, daemon_running

    paths, pid = DaemonPaths.here(), None
    if daemon_running(paths):
        try:
            pid = int(paths.pid.read_text().strip())
        except (OSError, ValueError):
            raise MpadviseError(f"a daemon holds {paths.lock} but {paths.pid} is missing or unreadable; "
                                "find it with `fuser` or `lsof` on the lock file and stop it by hand") from None
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        except PermissionError:
            raise MpadviseError(f"not allowed to signal the daemon (pid {pid}); it runs as another user") from None
        deadline = time.monotonic() + wait
        while daemon_running(paths):
            if time.monotonic() > deadline:
                raise MpadviseError(f"the daemon (pid {pid}) did not stop within {wait:g} s; "
                                    f"`kill -9 {pid}` forces it (its jobs are queued again at the next start)")
            time.sleep(0.1)
    if json_output:
        print_json({"stopped": pid is not None, "pid": pid, "directory": str(paths.directory)})
    elif pid is not None:
        console.print(f"stopped the mpadvise daemon (pid {pid})", highlight=False)
    else:
        console.print(f"no mpadvise daemon is running for {paths.directory}; nothing to stop", highlight=False)


def status(
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Show at most this many recent jobs.")] = 20,
    json_output: JsonOption = False,
) -> None:
    """Whether the daemon answers, its slots, and the recent jobs."""
    from advisor.daemon import DaemonClient

    client = DaemonClient.local(need_token=True)  # reading jobs needs the token
    report = {"running": True, "where": client.where, "health": client.health(),
              "jobs": client.jobs(limit=limit)}
    emit(report, json_output, render_status)


def check_uds(uds: Path | None) -> None:
    """Refuse now, in one line, a ``--uds`` socket path whose directory is not there."""
    if uds is None:
        return
    directory = uds.absolute().parent
    if not directory.is_dir():
        why = "is not a directory" if directory.exists() else "does not exist"
        raise UsageError(f"--uds {uds}: its directory {directory} {why}; name a socket path in an existing "
                         "directory")


def rotate_log(path: Path, *, max_bytes: int = MAX_DAEMON_LOG_BYTES,
               keep: int = DAEMON_LOGS_KEPT) -> None:
    """Move ``path`` to ``path.1`` (and ``.1`` to ``.2``...) once it is ``max_bytes`` or more:
    rotating at each start bounds what a long series of daemons leaves behind."""
    try:
        if path.stat().st_size < max_bytes:
            return
    except OSError:
        return
    for number in range(keep, 0, -1):
        older = path.with_name(f"{path.name}.{number}")
        newer = path if number == 1 else path.with_name(f"{path.name}.{number - 1}")
        with contextlib.suppress(OSError):
            if number == keep:
                older.unlink(missing_ok=True)
            os.replace(newer, older)


def render_status(report: dict[str, Any], console: Console) -> None:
    health = report["health"]
    counts = ", ".join(f"{n} {state}" for state, n in health["jobs"].items() if n) or "no jobs waiting or running"
    console.print(f"mpadvise daemon {health['version']} at {report['where']} (pid {health['pid']}, "
                  f"up {_duration(health['uptime_s'])}): {counts}", highlight=False)
    slots = Table(*(Column(col, no_wrap=True) for col in ("slot", "job", "doing")), title="slots",
                  title_justify="left")
    for slot in health["slots"]:
        slots.add_row(slot["name"], (slot.get("job") or "-")[:12], slot["phase"])
    console.print(slots)
    if not report["jobs"]:
        console.print("no jobs yet; queue one with `mpadvise tune --submit SCRIPT`")
        return
    jobs = Table(*(Column(col, no_wrap=col != "last line", overflow="fold")
                   for col in ("id", "state", "script", "slot", "created", "last line")),
                 title="jobs (oldest first)", title_justify="left")
    for job in report["jobs"]:
        jobs.add_row(job["id"][:12], job["state"], Path(job["script"]).name, job.get("gpu") or job.get("requested_gpu")
                     or "-", job["created_at"][:19].replace("T", " "), _job_line(job))
    console.print(jobs)


def _job_line(job: dict[str, Any]) -> str:
    """One line about a job: its answer when it finished, else what it is doing."""
    result = job.get("result") or {}
    tune = result.get("tune")
    if tune is not None:
        if tune.get("winner_label"):
            # The tune's one figure, with what it rests on (``speedup.basis``), as the tune printed it.
            speed, basis = tune.get("speedup_vs_fp32"), (tune.get("speedup") or {}).get("basis")
            return f"winner {tune['winner_label']}" + (f", {speed:.2f}x fp32 goodput" if speed else "") + (
                f" ({basis})" if speed and basis else "")
        return "no stable policy fits"
    if result.get("error"):
        return str(result["error"])
    progress = job.get("progress") or {}
    return str((progress.get("recent") or [None])[-1] or progress.get("message") or "")


def _last_log_line(path: Path) -> str:
    try:
        lines = [ln.strip() for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return "(no log)"
    errors = [line.removeprefix("error:").strip() for line in lines if line.startswith("error:")]
    return errors[-1] if errors else lines[-1] if lines else "(empty log)"


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


app = typer.Typer(name="daemon", help="A local service: cached recommendations over HTTP, and tune jobs queued one "
                  "per GPU.", no_args_is_help=True)
for _command in (run, start, stop, status):
    app.command(_command.__name__)(handle_errors(_command))
