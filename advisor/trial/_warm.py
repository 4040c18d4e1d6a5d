"""Warm trials: a server that imports torch and the project once and forks one launcher per trial.

On a small workload start-up is most of a trial: a fresh interpreter spends seconds importing
torch before the script's first line. The warm server (``serve``, started by ``WarmLauncher``)
pays that once. It imports torch and the project, runs no torch op, starts no thread and never
initialises CUDA, and then, for each trial, forks a child that is what the cold launch's
``_proctree.py`` launcher is: in a session of its own, a child subreaper (``supervise``) whose
own forked child runs the script as ``python [LAUNCH...] SCRIPT ARGS`` would
(``run_as_python``), with the trial's stdio, environment and working directory. A timeout
kills that tree as it kills a cold one (``end_trial`` on the launcher's pid).

A trial starts cold instead (``cold_reason``, ``environment_difference``, ``server_refusal``)
where a fork is not as good as a fresh interpreter: no fork (not Linux); several processes
(the rank launcher, ``_ranks``, starts its own); a command this module cannot run as the interpreter would; an
environment that differs from the server's in a variable torch or a library may have read at
import (only ``PER_TRIAL_PREFIXES``/``PER_TRIAL_NAMES`` may differ); a server with a second
thread or CUDA initialised; a server that died or did not start; or ``MPADVISE_WARM_TRIALS=0``.

The parent and the server speak JSON over a private Unix socket pair (``SOCK_SEQPACKET``: one
message per packet), the trial's stdout and stderr passed along as descriptors. When the
parent's end closes (the parent died), the server ends the trial it runs, and itself.

This module is the parent's side: ``WarmLauncher`` decides, trial by trial, whether it is
forked or started cold, and keeps the count; ``WarmServer`` is the server's process as the parent
holds it. The server's side is ``_warm_server``; when a trial starts cold, ``_cold_reasons``;
what both launches share to run a trial "as python would", ``_python_command``; ``_run`` is the
cold launch's entry point and the server's.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from advisor._log import get_logger

from ._cold_reasons import cold_reason, environment_reason, is_per_trial
from ._proctree import kill_tree
from ._python_command import RUN_MODULE
from ._warm_server import PACKET, SERVER_FLAG

START_TIMEOUT = 600.0
"""Seconds the parent waits for the server's imports (a framework's under load take a minute)."""


class _Channel:
    """The parent's end of the socket pair: JSON messages, descriptors alongside."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def send(self, message: Mapping[str, Any], fds: Sequence[int] = ()) -> bool:
        """Send ``message``; ``False`` when the server is gone."""
        try:
            socket.send_fds(self.sock, [json.dumps(message).encode()], list(fds))
            return True
        except OSError:
            return False

    def receive(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message; ``None`` when the server is gone.

        Raises:
            TimeoutError: nothing came within ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready, _, _ = select.select([self.sock], [], [], left)
            except InterruptedError:
                continue
            if not ready:
                raise TimeoutError
            try:
                data = self.sock.recv(PACKET)
            except OSError:
                return None
            return json.loads(data) if data else None


class WarmTrial:
    """A launcher forked by the warm server, as ``run_trial`` and ``end_trial`` use a Popen:
    ``pid``, ``wait(timeout)`` (``subprocess.TimeoutExpired``), ``kill()``, ``returncode``.

    The server reports the launcher's end without reaping it, and reaps it when this handle has
    seen the status: until then the pid is the launcher's (a zombie at worst) and a kill cannot
    hit another process, as with a Popen not yet waited for.
    """

    def __init__(self, channel: _Channel, pid: int, args: list[str], on_lost: Callable[[], None]) -> None:
        self._channel = channel
        self.pid = pid
        self.args = args
        self.returncode: int | None = None
        self._on_lost = on_lost

    def wait(self, timeout: float | None = None) -> int:
        """The launcher's exit status, as ``Popen.returncode`` gives it (``-N``: signal N)."""
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
            kill_tree(self.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGKILL)
                os.kill(self.pid, signal.SIGKILL)
            self.returncode = -int(signal.SIGKILL)
            return self.returncode
        self.returncode = int(message["exit"])
        self._channel.send({"op": "reap"})
        return self.returncode

    def poll(self) -> int | None:
        """The exit status if the launcher has ended, else ``None``."""
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        """SIGKILL the launcher, unless its end was already seen."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.pid, signal.SIGKILL)


def _close_server(proc: subprocess.Popen[bytes] | None, sock: socket.socket | None) -> None:
    """Close the channel (the server ends at its end of it), then make sure the server ended."""
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.close()
    if proc is not None:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class WarmServer:
    """One warm server's process, as the parent holds it: started in ``env`` (it imports in the
    background), then waited for (``await_ready``), asked to fork trials (``fork``) and closed.

    Args:
        python: the interpreter of the server, and of its trials.
        preload: modules the server imports beyond torch and the project.
        env: the environment the server starts in: the first trial's whole environment.

    Raises:
        OSError: the server's process could not be started.
    """

    def __init__(self, python: str, preload: Sequence[str], env: Mapping[str, str]) -> None:
        # The server starts in the first trial's whole environment. A fork's /proc/PID/environ is
        # the server's, whatever the fork sets in os.environ, and the daemon finds (and ends) a
        # job's processes by the mark its environment carries there (MPADVISE_DAEMON_JOB).
        # Per-trial values are set in each fork; the server reads none of them.
        self.env = dict(env)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log: IO[bytes] = tempfile.TemporaryFile()
        try:
            self.proc = subprocess.Popen(
                [python, "-P", "-m", RUN_MODULE, SERVER_FLAG, str(child.fileno()), *preload],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._log,
                env=self.env,
                pass_fds=(child.fileno(),),
                start_new_session=True,  # Ctrl-C in the terminal reaches the parent, which ends it
            )
        except OSError:
            parent.close()
            self._log.close()
            raise
        finally:
            child.close()
        self.channel = _Channel(parent)
        self.ready = False  # the server said it is ready (one started ahead may still be importing)
        self._finalizer = weakref.finalize(self, _close_server, self.proc, parent)

    def await_ready(self) -> str | None:
        """Wait for the server's word; why it cannot serve (it refused, or never came), or
        ``None``."""
        try:
            ready = self.channel.receive(START_TIMEOUT)
        except TimeoutError:
            ready = None
        if ready is None:
            return f"the warm server failed to start: {self._log_tail()}"
        if ready.get("refusal"):
            return str(ready["refusal"])
        self.ready = True
        return None

    def fork(self, command: list[str], env: Mapping[str, str], cwd: str | os.PathLike[str] | None,
             stdout: IO[bytes], stderr: IO[bytes], on_lost: Callable[[], None]) -> WarmTrial | str:
        """Have the server fork a launcher that runs ``python COMMAND``: its handle, or why not
        (the server died, or refused: a thread or CUDA in it stays, and so would the refusal)."""
        request = {
            "op": "run",
            "argv": command,
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": {k: v for k, v in env.items() if is_per_trial(k)},
        }
        for f in (stdout, stderr):
            f.flush()
        if not self.channel.send(request, [stdout.fileno(), stderr.fileno()]):
            return "the warm server died"
        try:
            reply = self.channel.receive(START_TIMEOUT)
        except TimeoutError:
            reply = None
        if reply is None:
            return "the warm server died"
        if "pid" not in reply:
            return str(reply.get("cold") or reply)
        return WarmTrial(self.channel, int(reply["pid"]), command, on_lost)

    def _log_tail(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            self._log.seek(0)
            lines = self._log.read().decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else "it ended without a word"
        return ""

    def close(self) -> None:
        """End the server (it ends any trial it still runs). One still importing has forked
        nothing: it is killed, not waited for."""
        if not self.ready:
            with contextlib.suppress(OSError):
                self.proc.kill()
        self._finalizer()
        self._log.close()


class WarmLauncher:
    """Forks trials from one warm server, started on the first trial (or ahead of it, by
    ``prestart``) and kept until ``close``.

    Args:
        python: the interpreter of the trials, and of the server.
        preload: modules the server imports beyond torch and the project
            (``framework_preload``).

    Attributes:
        forked: how many trials the server forked.
        last_cold_reason: why the latest trial that started cold did; ``None`` before one did.
    """

    def __init__(self, python: str = sys.executable, *, preload: Sequence[str] = ()) -> None:
        self.python = python
        self.preload = tuple(preload)
        self._server: WarmServer | None = None
        self._broken: str | None = None  # why the server cannot serve; every trial then starts cold
        self.forked = 0
        self.last_cold_reason: str | None = None

    @property
    def server_pid(self) -> int | None:
        """The running server's pid; ``None`` before it started, after ``close``."""
        return None if self._server is None else self._server.proc.pid

    def start_trial(
        self,
        command: Sequence[str],
        *,
        env: Mapping[str, str],
        cwd: str | os.PathLike[str] | None,
        stdout: IO[bytes],
        stderr: IO[bytes],
        python: str,
        nproc_per_node: int = 1,
    ) -> WarmTrial | None:
        """Fork ``python COMMAND`` from the server; ``None`` (and a debug line saying why) when
        the trial must start cold instead.

        Args:
            command: what follows the interpreter (``[LAUNCH...] SCRIPT ARGS``).
            env: the trial's whole environment.
            cwd: its working directory (``None``: this process's).
            stdout, stderr: files the trial writes to.
            python: the trial's interpreter; another than the server's starts cold.
            nproc_per_node: processes of the trial.
        """
        reason = cold_reason(command, environ={**os.environ, **env}, nproc_per_node=nproc_per_node)
        if reason is None and os.path.abspath(python) != os.path.abspath(self.python):
            reason = f"the trial's interpreter {python} is not the warm server's {self.python}"
        if reason is None:
            reason = self._broken or self._ensure_server(env)
        if reason is None and self._server is not None:
            reason = environment_reason(self._server.env, env)
            if reason is not None and self.forked == 0:
                # A server started ahead of the first trial (``prestart``) in an environment that
                # has changed since: start it again in the trial's, as on a first trial.
                get_logger().debug(f"warm server started again: {reason}")
                self.close()
                reason = self._ensure_server(env)
        trial = None
        if reason is None and self._server is not None:
            forked = self._server.fork(list(command), env, cwd, stdout, stderr,
                                       lambda: self._lost("the warm server died"))
            if isinstance(forked, str):
                reason = self._lost(forked)
            else:
                trial = forked
        if trial is None:
            self.last_cold_reason = reason
            get_logger().debug(f"trial launched cold: {reason}")
        else:
            self.forked += 1
        return trial

    def prestart(self, command: Sequence[str], *, env: Mapping[str, str], nproc_per_node: int = 1) -> bool:
        """Start the server now, without waiting for its imports; whether one was started.

        A parent with work of its own before its first trial (importing torch, probing the
        hardware, the matmul benchmark) does it while the server imports, instead of before.
        The first trial waits for the server to be ready, as it would have waited for the
        server it started. Nothing starts where that trial would start cold anyway
        (``cold_reason`` for ``command``), nor when a server runs already.

        Args:
            command: what the trials run after the interpreter (``[LAUNCH...] SCRIPT ARGS``).
            env: the environment the trials will have, but for their per-trial variables
                (``trial_environment``); a first trial whose environment differs in anything
                else starts the server again in its own.
            nproc_per_node: processes of each trial.
        """
        if self._server is not None or self._broken is not None:
            return False
        if cold_reason(command, environ={**os.environ, **env}, nproc_per_node=nproc_per_node) is not None:
            return False
        return self._spawn(env) is None

    def _ensure_server(self, env: Mapping[str, str]) -> str | None:
        """Start the server unless it runs, and wait until it is ready; why it cannot serve, or
        ``None``."""
        if self._server is None:
            failed = self._spawn(env)
            if failed is not None:
                return failed
        assert self._server is not None
        if self._server.ready:
            return None
        failed = self._server.await_ready()
        return None if failed is None else self._lost(failed)

    def _spawn(self, env: Mapping[str, str]) -> str | None:
        """Start the server's process; why it could not start, or ``None``."""
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
        """End the server (it ends any trial it still runs); a later trial starts a new one,
        unless the server was found unable to serve."""
        if self._server is not None:
            server, self._server = self._server, None
            server.close()

    def __enter__(self) -> WarmLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
