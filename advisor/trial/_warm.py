"""Warm trials, the parent's side: a server (``_warm_server``) imports torch and the project once
and forks one launcher per trial, saving the seconds a fresh interpreter spends importing torch;
``WarmLauncher`` decides per trial whether it is forked or started cold (``cold_reason``). They
speak JSON over a private ``SOCK_SEQPACKET`` pair, the trial's stdio passed as descriptors; when
the parent's end closes, the server ends the trial it runs, and itself."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from advisor._log import get_logger

from ._proctree import end_trial
from ._python_command import RUN_MODULE, parse_command
from ._warm_server import SERVER_FLAG, Channel, is_per_trial

START_TIMEOUT = 600.0  # seconds for the server's imports (a framework's under load take a minute)
WARM_ENV = "MPADVISE_WARM_TRIALS"  # 0 starts every trial in a fresh interpreter


def warm_switched_off(environ: Mapping[str, str]) -> bool:
    return environ.get(WARM_ENV, "").strip().lower() in ("0", "false", "no", "off")


def cold_reason(command: Sequence[str], *, environ: Mapping[str, str], nproc_per_node: int = 1,
                platform: str = sys.platform, can_fork: bool = hasattr(os, "fork")) -> str | None:
    """Why a trial must start in a fresh interpreter, whatever the server; None if it may fork."""
    if warm_switched_off(environ):
        return f"{WARM_ENV}={environ.get(WARM_ENV)} starts every trial cold"
    if not platform.startswith("linux") or not can_fork:
        return f"warm trials need Linux's fork and child subreaper; this is {platform}"
    if nproc_per_node > 1:
        return (f"a trial of {nproc_per_node} processes starts its ranks from its own launcher (in torchrun's "
                "place), which starts each one itself")
    if parse_command(command) is None:
        return f"the command {list(command)[:4]} is not one a forked interpreter runs as python would"
    return None


def environment_difference(server: Mapping[str, str], trial: Mapping[str, str]) -> list[str]:
    names = set(server) | set(trial)
    return sorted(n for n in names if not is_per_trial(n) and server.get(n) != trial.get(n))


def environment_reason(server: Mapping[str, str], trial: Mapping[str, str]) -> str | None:
    differ = environment_difference(server, trial)
    if not differ:
        return None
    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    return (f"the trial's environment differs from the warm server's in {shown}, which torch or a "
            "library may have read at import")


def framework_preload(launch: Sequence[str]) -> tuple[str, ...]:
    """What a warm server imports for trials launched by ``launch``: for a framework boot
    (``-P -m PACKAGE._boot FRAMEWORK``), its package and ``PACKAGE:FRAMEWORK`` (its library)."""
    command = parse_command([*launch, "script.py"])
    if command is None or not command.module or not command.target.endswith("._boot") or len(command.args) < 2:
        return ()
    package = command.target.rpartition(".")[0]
    return (package, f"{package}:{command.args[0]}")


class WarmTrial:
    """A launcher forked by the warm server, used as a Popen. The server reaps it only once this
    handle has seen its status, so until then a kill cannot hit another process."""

    def __init__(self, channel: Channel, pid: int, args: list[str], on_lost: Callable[[], None]) -> None:
        self._channel = channel
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._on_lost = on_lost

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        try:
            message = self._channel.receive(timeout)
        except TimeoutError:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0) from None
        if message is None or "exit" not in message:
            # The server died under the trial: end the orphaned tree here, where it can still be
            # found below the launcher's pid, and report it as killed.
            self._on_lost()
            end_trial(self.pid)
            self.returncode = -int(signal.SIGKILL)
            return self.returncode
        self.returncode = int(message["exit"])
        self._channel.send({"op": "reap"})
        return self.returncode


def _close_server(proc: subprocess.Popen[bytes], sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()  # the server ends at its end of the channel
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class WarmServer:
    """One warm server's process, started in ``env``: the first trial's whole environment. A
    fork's /proc/PID/environ is the server's, whatever the fork sets in os.environ, and the
    daemon finds (and ends) a job's processes by the mark its environment carries there
    (MPADVISE_DAEMON_JOB). Per-trial values are set in each fork; the server reads none of them."""

    def __init__(self, python: str, preload: Sequence[str], env: Mapping[str, str]) -> None:
        self.env = dict(env)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log: IO[bytes] = tempfile.TemporaryFile()
        try:
            # A session of its own: Ctrl-C in the terminal reaches the parent, which ends it.
            self.proc = subprocess.Popen(
                [python, "-P", "-m", RUN_MODULE, SERVER_FLAG, str(child.fileno()), *preload],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=self._log, env=self.env,
                pass_fds=(child.fileno(),), start_new_session=True)
        except OSError:
            parent.close()
            self._log.close()
            raise
        finally:
            child.close()
        self.channel = Channel(parent)
        self.ready = False  # the server said it is ready (one started ahead may still be importing)
        self._finalizer = weakref.finalize(self, _close_server, self.proc, parent)

    def _reply(self) -> dict[str, Any] | None:
        with contextlib.suppress(TimeoutError):
            return self.channel.receive(START_TIMEOUT)
        return None

    def await_ready(self) -> str | None:
        """Wait for the server's word; why it cannot serve, or ``None``."""
        ready = self._reply()
        if ready is None:
            lines = []
            with contextlib.suppress(OSError, ValueError):
                self._log.seek(0)
                lines = self._log.read().decode(errors="replace").strip().splitlines()
            return f"the warm server failed to start: {lines[-1] if lines else 'it ended without a word'}"
        if ready.get("refusal"):
            return str(ready["refusal"])
        self.ready = True
        return None

    def fork(self, command: list[str], env: Mapping[str, str], cwd: str | os.PathLike[str] | None,
             stdout: IO[bytes], stderr: IO[bytes], on_lost: Callable[[], None]) -> WarmTrial | str:
        """Have the server fork a launcher that runs ``python COMMAND``: its handle, or why not."""
        request = {"op": "run", "argv": command, "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
                   "env": {k: v for k, v in env.items() if is_per_trial(k)}}
        for f in (stdout, stderr):
            f.flush()
        sent = self.channel.send(request, [stdout.fileno(), stderr.fileno()])
        reply = self._reply() if sent else None
        if reply is None:
            return "the warm server died"
        if "pid" not in reply:
            return str(reply.get("cold") or reply)
        return WarmTrial(self.channel, int(reply["pid"]), command, on_lost)

    def close(self) -> None:
        # One still importing has forked nothing: it is killed, not waited for.
        if not self.ready:
            with contextlib.suppress(OSError):
                self.proc.kill()
        self._finalizer()
        self._log.close()


class WarmLauncher:
    """Forks trials from one warm server, started on the first trial (or ahead of it, by
    ``prestart``) and kept until ``close``; ``preload``: what ``framework_preload`` names."""

    def __init__(self, python: str = sys.executable, *, preload: Sequence[str] = ()) -> None:
        self.python = python
        self.preload = tuple(preload)
        self._server: WarmServer | None = None
        self._broken: str | None = None  # why the server cannot serve; every trial then starts cold
        self.forked = 0
        self.last_cold_reason: str | None = None

    @property
    def server_pid(self) -> int | None:
        return None if self._server is None else self._server.proc.pid

    def start_trial(self, command: Sequence[str], *, env: Mapping[str, str],
                    cwd: str | os.PathLike[str] | None, stdout: IO[bytes], stderr: IO[bytes], python: str,
                    nproc_per_node: int = 1) -> WarmTrial | None:
        """Fork ``python COMMAND`` from the server; None (and a debug line why) to start cold."""
        reason = cold_reason(command, environ={**os.environ, **env}, nproc_per_node=nproc_per_node)
        if reason is None and os.path.abspath(python) != os.path.abspath(self.python):
            reason = f"the trial's interpreter {python} is not the warm server's {self.python}"
        reason = reason or self._broken or self._ensure_server(env)
        if reason is None and self._server is not None:
            reason = environment_reason(self._server.env, env)
            if reason is not None and self.forked == 0:
                # A server started ahead of the first trial (``prestart``) in an environment that
                # has changed since: start it again in the trial's, as on a first trial.
                get_logger().debug(f"warm server started again: {reason}")
                self.close()
                reason = self._ensure_server(env)
        if reason is None and self._server is not None:
            forked = self._server.fork(list(command), env, cwd, stdout, stderr,
                                       lambda: self._lost("the warm server died"))
            if not isinstance(forked, str):
                self.forked += 1
                return forked
            reason = self._lost(forked)
        self.last_cold_reason = reason
        get_logger().debug(f"trial launched cold: {reason}")
        return None

    def prestart(self, command: Sequence[str], *, env: Mapping[str, str], nproc_per_node: int = 1) -> bool:
        """Start the server now, its imports overlapping the parent's work; whether one started."""
        if self._server is not None or self._broken is not None or cold_reason(
                command, environ={**os.environ, **env}, nproc_per_node=nproc_per_node) is not None:
            return False
        return self._spawn(env) is None

    def _ensure_server(self, env: Mapping[str, str]) -> str | None:
        """Start the server unless it runs and wait until it is ready; why it cannot serve."""
        if self._server is None and (failed := self._spawn(env)) is not None:
            return failed
        assert self._server is not None
        if self._server.ready:
            return None
        failed = self._server.await_ready()
        return None if failed is None else self._lost(failed)

    def _spawn(self, env: Mapping[str, str]) -> str | None:
        try:
            self._server = WarmServer(self.python, self.preload, env)
        except OSError as exc:
            return self._lost(f"the warm server failed to start: {exc}")
        return None

    def _lost(self, reason: str) -> str:
        """The server is gone, never came or refused: later trials start cold, for ``reason``."""
        self._broken = reason
        self.close()
        return reason

    def close(self) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            server.close()

    def __enter__(self) -> WarmLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
