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

This module also holds what both launches share to run a trial "as python would"
(``parse_command``, ``run_as_python``, ``exit_forked``); ``_run`` is the cold launch's entry
point and the server's.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any, NoReturn

from advisor._log import get_logger

from ._proctree import _exit_as, end_with_parent, kill_tree, supervise
from ._ranks import AfterImport
from ._timeline import clear, mark

WARM_ENV = "MPADVISE_WARM_TRIALS"
"""``0`` starts every trial in a fresh interpreter (the cold launch), as before warm trials."""
RUN_MODULE = "advisor.trial._run"
"""The module a cold trial runs under, and the warm server's entry point."""
SERVER_FLAG = "--warm-server"
"""``python -P -m advisor.trial._run --warm-server FD [PRELOAD...]`` is the warm server."""
PER_TRIAL_PREFIXES: tuple[str, ...] = ("MPADVISE_",)
"""Variables a trial's environment may set differently from the server's: the project's own,
which it reads when a trial uses them, never at import."""
PER_TRIAL_NAMES: frozenset[str] = frozenset({"PWD", "OLDPWD"})
"""More such variables: a shell's record of the working directory, which the request carries."""
THREADS_ENV = "MPADVISE_TRIAL_THREADS"
"""How many threads the trial's torch ops may use (``TrialSpec.threads``), where other processes
keep some of the cores busy; unset leaves torch's own choice."""
START_TIMEOUT = 600.0
"""Seconds the parent waits for the server's imports (a framework's under load take a minute)."""
_PACKET = 1 << 20


# --- running a command as the interpreter would ------------------------------------------------


@dataclass(frozen=True)
class PythonCommand:
    """What follows ``python`` on a trial's command line, as the interpreter reads it.

    Attributes:
        target: the script's path, or the module's name when ``module`` is true.
        args: the arguments after the target (``sys.argv[1:]``).
        module: ``-m``: the target is a module run as ``__main__``.
        safe_path: ``-P``: nothing is put before ``sys.path`` (neither the script's directory
            nor the working directory).
    """

    target: str
    args: tuple[str, ...] = ()
    module: bool = False
    safe_path: bool = False


def parse_command(argv: Sequence[str]) -> PythonCommand | None:
    """Read ``[-P...] (-m MODULE | SCRIPT) [ARGS...]``; ``None`` for anything else (another
    interpreter option, ``-c``, a script on stdin, no target), which only an interpreter runs
    faithfully."""
    safe_path, rest = False, list(argv)
    while rest and rest[0] == "-P":
        safe_path, rest = True, rest[1:]
    if not rest or not rest[0]:
        return None
    if rest[0] == "-m":
        if len(rest) < 2 or not rest[1] or rest[1].startswith("-"):
            return None
        return PythonCommand(rest[1], tuple(rest[2:]), module=True, safe_path=safe_path)
    if rest[0].startswith("-"):
        return None
    return PythonCommand(rest[0], tuple(rest[1:]), safe_path=safe_path)


def cold_command(python: str, command: Sequence[str], *, nproc_per_node: int = 1) -> list[str]:
    """The command line of a cold trial: ``python -P -m advisor.trial._run COMMAND...``, which
    marks torch's import on the trial's timeline, where that runs ``COMMAND`` as the
    interpreter would; otherwise (the rank launcher, an option it does not read) ``python
    COMMAND...`` itself."""
    if nproc_per_node == 1 and parse_command(command) is not None:
        return [python, "-P", "-m", RUN_MODULE, *command]
    return [python, *command]


def exit_code(exc: SystemExit) -> int:
    """The status ``raise SystemExit(code)`` ends an interpreter with; a code that is not an
    integer is printed on stderr, and the status is 1, as the interpreter does."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _trimmed(tb: Any) -> Any:
    """The traceback from the script's own frames on, without this module's and runpy's, as
    the interpreter shows a script's error."""
    ours = {os.path.abspath(__file__), os.path.abspath(runpy.__file__)}
    while tb is not None and os.path.abspath(tb.tb_frame.f_code.co_filename) in ours:
        tb = tb.tb_next
    return tb


def run_as_python(command: PythonCommand) -> int:
    """Run ``command`` in this process as ``python COMMAND`` would; its exit status.

    ``sys.argv`` and ``sys.path[0]`` are the interpreter's; ``SystemExit`` gives the status; an
    uncaught exception goes to ``sys.excepthook`` (printed, and recorded by a trial's hook) and
    gives 1, or ``-SIGINT`` for a KeyboardInterrupt (the interpreter then ends by SIGINT).
    """
    sys.argv = [command.target, *command.args]  # runpy puts a module's file in argv[0]
    if not command.safe_path:
        sys.path.insert(0, os.getcwd() if command.module else os.path.dirname(os.path.abspath(command.target)))
    try:
        if command.module:
            runpy.run_module(command.target, run_name="__main__", alter_sys=True)
        elif not os.path.exists(command.target):
            print(f"{sys.executable}: can't open file {os.path.abspath(command.target)!r}: "
                  "[Errno 2] No such file or directory", file=sys.stderr)
            return 2
        else:
            runpy.run_path(command.target, run_name="__main__")
    except SystemExit as exc:
        return exit_code(exc)
    except BaseException as exc:  # whatever the script raised ends it, as under python
        sys.excepthook(type(exc), exc, _trimmed(exc.__traceback__))
        return -int(signal.SIGINT) if isinstance(exc, KeyboardInterrupt) else 1
    return 0


def exit_forked(code: int) -> NoReturn:
    """End this process as the interpreter ends after a script: the script's non-daemon
    threads joined, ``atexit`` handlers run, stdio flushed; then ``os._exit`` (so that in a
    forked child nothing of the server's stack runs on), or the signal of a negative code."""
    try:
        shutdown = getattr(threading, "_shutdown", None)  # the interpreter's own join of threads
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(AttributeError, OSError, ValueError):
                stream.flush()
        _exit_as(code)


def apply_trial_threads() -> None:
    """Give torch the thread count the trial was asked to use (``THREADS_ENV``), now if torch is
    imported already (a forked trial), else as soon as the script imports it; nothing when unset.

    On a CPU that other processes keep partly busy, an operation split over more threads than
    there are free cores waits at every barrier for a thread the scheduler has put aside: on 2
    cores beside one busy process, examples/mlp.py's step went from 3.8 ms to 280 ms.
    """
    value = os.environ.get(THREADS_ENV, "")
    if not value.isdigit() or int(value) < 1:
        return
    threads = int(value)

    def set_threads(torch: Any) -> None:
        torch.set_num_threads(threads)

    if "torch" in sys.modules:
        set_threads(sys.modules["torch"])
    else:
        sys.meta_path.insert(0, AfterImport("torch", set_threads))


def mark_torch_import() -> None:
    """Mark ``torch_imported`` on this trial's timeline: now if torch is imported already (a
    forked trial), else when the script's own ``import torch`` is done.

    The cold launch does not import torch itself: a script may set a variable torch reads at
    import (``OMP_NUM_THREADS``) before its ``import torch``, and one that never imports torch
    starts as fast as before.
    """
    if "torch" in sys.modules:
        mark("torch_imported")
    else:
        sys.meta_path.insert(0, AfterImport("torch", lambda module: mark("torch_imported")))


# --- when a trial starts cold --------------------------------------------------------------------


def is_per_trial(name: str) -> bool:
    """Whether a variable may differ between a trial's environment and the warm server's."""
    return name in PER_TRIAL_NAMES or name.startswith(PER_TRIAL_PREFIXES)


def environment_difference(server: Mapping[str, str], trial: Mapping[str, str]) -> list[str]:
    """The variables, other than per-trial ones, that the trial's environment sets differently
    from the server's start-up environment (set in one only, or to another value); sorted."""
    names = set(server) | set(trial)
    return sorted(n for n in names if not is_per_trial(n) and server.get(n) != trial.get(n))


def warm_switched_off(environ: Mapping[str, str]) -> bool:
    """Whether ``MPADVISE_WARM_TRIALS`` asks for cold trials (``0``, ``false``, ``no``, ``off``)."""
    return environ.get(WARM_ENV, "").strip().lower() in ("0", "false", "no", "off")


def cold_reason(
    command: Sequence[str],
    *,
    environ: Mapping[str, str],
    nproc_per_node: int = 1,
    platform: str = sys.platform,
    can_fork: bool = hasattr(os, "fork"),
) -> str | None:
    """Why a trial must start in a fresh interpreter, whatever the server; ``None`` when it may
    be forked.

    Args:
        command: what follows the interpreter on the trial's command line.
        environ: the environment the parent runs in, and the trial's (either may hold the switch).
        nproc_per_node: processes of the trial; the rank launcher (``_ranks``) starts its own.
        platform, can_fork: ``sys.platform`` and whether ``os.fork`` exists; a test passes others.
    """
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


def environment_reason(server: Mapping[str, str], trial: Mapping[str, str]) -> str | None:
    """Why a trial in environment ``trial`` cannot be forked from a server started in ``server``."""
    differ = environment_difference(server, trial)
    if not differ:
        return None
    shown = ", ".join(differ[:5]) + (f" and {len(differ) - 5} more" if len(differ) > 5 else "")
    return (f"the trial's environment differs from the warm server's in {shown}, which torch or a "
            "library may have read at import")


def server_refusal(threads: int, cuda_initialized: bool) -> str | None:
    """Why the server must not fork (a fork copies one thread and a CUDA context that the child
    cannot use); ``None`` when it may."""
    if cuda_initialized:
        return "CUDA is initialised in the warm server, and a forked child cannot use it"
    if threads != 1:
        return f"the warm server runs {threads} threads, and a fork copies only one"
    return None


def thread_count() -> int:
    """Threads of this process, native ones included (``/proc/self/task``)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def framework_preload(launch: Sequence[str]) -> tuple[str, ...]:
    """What a warm server imports for trials launched by ``launch``: for a framework boot
    (``-P -m PACKAGE._boot FRAMEWORK``), its package and, as ``PACKAGE:FRAMEWORK``, the modules
    that framework is detected by (its library: Lightning, transformers, accelerate)."""
    command = parse_command([*launch, "script.py"])
    if command is None or not command.module or not command.target.endswith("._boot") or len(command.args) < 2:
        return ()
    package = command.target.rpartition(".")[0]
    return (package, f"{package}:{command.args[0]}")


# --- the parent's side -------------------------------------------------------------------------


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
                data = self.sock.recv(_PACKET)
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
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: _Channel | None = None
        self._env: dict[str, str] | None = None
        self._log: IO[bytes] | None = None
        self._broken: str | None = None  # why the server cannot serve; every trial then starts cold
        self._finalizer: weakref.finalize | None = None
        self._ready = False  # the server said it is ready (a prestarted one may still be importing)
        self.forked = 0
        self.last_cold_reason: str | None = None

    @property
    def server_pid(self) -> int | None:
        """The running server's pid; ``None`` before it started, after ``close``."""
        return None if self._proc is None else self._proc.pid

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
        if reason is None and self._env is not None:
            reason = environment_reason(self._env, env)
            if reason is not None and self.forked == 0:
                # A server started ahead of the first trial (``prestart``) in an environment that
                # has changed since: start it again in the trial's, as on a first trial.
                get_logger().debug(f"warm server started again: {reason}")
                self.close()
                reason = self._ensure_server(env)
        trial = None
        if reason is None:
            trial, reason = self._fork(list(command), env, cwd, stdout, stderr)
        if trial is None:
            self.last_cold_reason = reason
            get_logger().debug(f"trial launched cold: {reason}")
        else:
            self.forked += 1
        return trial

    def _fork(self, command: list[str], env: Mapping[str, str], cwd: str | os.PathLike[str] | None,
              stdout: IO[bytes], stderr: IO[bytes]) -> tuple[WarmTrial | None, str]:
        assert self._channel is not None
        request = {
            "op": "run",
            "argv": command,
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "env": {k: v for k, v in env.items() if is_per_trial(k)},
        }
        for f in (stdout, stderr):
            f.flush()
        if not self._channel.send(request, [stdout.fileno(), stderr.fileno()]):
            return None, self._lost("the warm server died")
        try:
            reply = self._channel.receive(START_TIMEOUT)
        except TimeoutError:
            reply = None
        if reply is None:
            return None, self._lost("the warm server died")
        if "pid" not in reply:
            reason = str(reply.get("cold") or reply)
            self._broken = reason  # a thread or CUDA in the server stays: so would the refusal
            self.close()
            return None, reason
        return WarmTrial(self._channel, int(reply["pid"]), command, lambda: self._lost("the warm server died")), ""

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
        if self._proc is not None or self._broken is not None:
            return False
        if cold_reason(command, environ={**os.environ, **env}, nproc_per_node=nproc_per_node) is not None:
            return False
        return self._spawn(env) is None

    def _ensure_server(self, env: Mapping[str, str]) -> str | None:
        """Start the server unless it runs, and wait until it is ready; why it cannot serve, or
        ``None``."""
        if self._proc is None:
            failed = self._spawn(env)
            if failed is not None:
                return failed
        return None if self._ready else self._await_ready()

    def _spawn(self, env: Mapping[str, str]) -> str | None:
        """Start the server's process; why it could not start, or ``None``."""
        # The server starts in the first trial's whole environment. A fork's /proc/PID/environ is
        # the server's, whatever the fork sets in os.environ, and the daemon finds (and ends) a
        # job's processes by the mark its environment carries there (MPADVISE_DAEMON_JOB).
        # Per-trial values are set in each fork; the server reads none of them.
        server_env = dict(env)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                [self.python, "-P", "-m", RUN_MODULE, SERVER_FLAG, str(child.fileno()), *self.preload],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=self._log,
                env=server_env,
                pass_fds=(child.fileno(),),
                start_new_session=True,  # Ctrl-C in the terminal reaches the parent, which ends it
            )
        except OSError as exc:
            parent.close()
            return self._lost(f"the warm server failed to start: {exc}")
        finally:
            child.close()
        self._channel = _Channel(parent)
        self._env = server_env
        self._ready = False
        self._finalizer = weakref.finalize(self, _close_server, self._proc, parent)
        return None

    def _await_ready(self) -> str | None:
        """Wait for the started server's word; why it cannot serve, or ``None``."""
        assert self._channel is not None
        try:
            ready = self._channel.receive(START_TIMEOUT)
        except TimeoutError:
            ready = None
        if ready is None:
            return self._lost(f"the warm server failed to start: {self._log_tail()}")
        if ready.get("refusal"):
            self._broken = str(ready["refusal"])
            self.close()
            return self._broken
        self._ready = True
        return None

    def _log_tail(self) -> str:
        if self._log is None:
            return ""
        with contextlib.suppress(OSError, ValueError):
            self._log.seek(0)
            lines = self._log.read().decode(errors="replace").strip().splitlines()
            return lines[-1] if lines else "it ended without a word"
        return ""

    def _lost(self, reason: str) -> str:
        """The server is gone (or never came): later trials start cold, for ``reason``."""
        self._broken = reason
        self.close()
        return reason

    def close(self) -> None:
        """End the server (it ends any trial it still runs); a later trial starts a new one,
        unless the server was found unable to serve. A server still importing (``prestart``,
        and a command that ended before its first trial) has forked nothing: it is killed, not
        waited for."""
        if self._proc is not None and not self._ready:
            with contextlib.suppress(OSError):
                self._proc.kill()
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None
        self._proc, self._channel, self._env, self._ready = None, None, None, False
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> WarmLauncher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the server's side -------------------------------------------------------------------------


def _send(sock: socket.socket, message: Mapping[str, Any]) -> bool:
    try:
        sock.send(json.dumps(message).encode())
        return True
    except OSError:
        return False


def _receive(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """The next request and its descriptors; ``None`` when the parent's end is closed."""
    try:
        data, fds, _, _ = socket.recv_fds(sock, _PACKET, 4)
    except OSError:
        return None, []
    return (json.loads(data) if data else None), list(fds)


def _preload(name: str) -> None:
    """Import ``name``, or for ``PACKAGE:FRAMEWORK`` the modules the framework is detected by;
    a module that does not import is left to the trial, which imports it itself."""
    package, _, framework = name.partition(":")
    try:
        module = importlib.import_module(package)
        if framework:
            for library in module.framework_class(framework).detected_by:
                with contextlib.suppress(Exception):
                    importlib.import_module(library)
    except Exception:  # noqa: BLE001, S110 - a preload is an optimisation; the trial will say what fails
        pass


def _settle() -> None:
    """Fork once and let the child end at once. A library may keep a thread pool that it shuts
    down before any fork (OpenBLAS, under numpy, starts one at import and registers
    ``pthread_atfork`` handlers for it); after this the server holds only what stays."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _exit_status(pid: int) -> int | None:
    """The status of child ``pid`` if it has ended, without reaping it (``WNOWAIT``)."""
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -int(signal.SIGKILL)
    if found is None or found.si_pid == 0:
        return None
    return found.si_status if found.si_code == os.CLD_EXITED else -found.si_status


def _watch(sock: socket.socket, pid: int) -> int | None:
    """Wait until launcher ``pid`` ends (its status) or the parent's end closes (``None``)."""
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None  # an older kernel: poll
    try:
        while True:
            watched = [sock] if pidfd is None else [sock, pidfd]
            ready, _, _ = select.select(watched, [], [], 0.05 if pidfd is None else None)
            if sock in ready:
                try:
                    data = sock.recv(_PACKET, socket.MSG_PEEK)
                except OSError:
                    data = b""
                if not data:
                    return None
                sock.recv(_PACKET)  # nothing is asked of a running trial: drop it
            status = _exit_status(pid)
            if status is not None:
                return status
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _end(pid: int) -> None:
    """End launcher ``pid`` and its tree, as ``end_trial`` does, and reap it."""
    kill_tree(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _reseed() -> None:
    """Give this forked child fresh random state where a fresh interpreter would have it:
    ``random`` reseeds itself after a fork; numpy's global generator, seeded at import, does not."""
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        with contextlib.suppress(Exception):
            numpy_random.seed()


def _run_script(command: PythonCommand, handlers: Mapping[int, Any]) -> int:
    """In the launcher: fork the process that runs the script; its pid."""
    launcher = os.getpid()
    pid = os.fork()
    if pid != 0:
        return pid
    code = 1
    try:
        for signum, handler in handlers.items():  # the launcher's SIGTERM and SIGHUP are its own
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, handler)
        end_with_parent(int(signal.SIGKILL), parent=launcher)  # nothing of a trial outlives its launcher
        _reseed()
        clear()  # the marks of this trial only
        mark("torch_imported")  # torch was imported before the fork
        apply_trial_threads()
        code = run_as_python(command)
    except BaseException:  # noqa: BLE001 - a fault here is the trial's, reported as a script's would be
        traceback.print_exc()
    exit_forked(code)


def _launcher(sock: socket.socket, request: Mapping[str, Any], fds: list[int], handlers: Mapping[int, Any]) -> NoReturn:
    """The forked child of the server: become the trial's launcher, as ``_proctree.py`` is."""
    server = os.getppid()
    try:
        os.setsid()  # a session of its own, so a timeout can kill its process group
        sock.close()  # the parent's death must reach the server alone, through its end
        out, err = fds
        devnull = os.open(os.devnull, os.O_RDONLY)
        for fd, target in ((devnull, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
        for fd in {devnull, out, err} - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        trial_env = request["env"]
        for name in [n for n in os.environ if is_per_trial(n) and n not in trial_env]:
            del os.environ[name]
        os.environ.update(trial_env)
        for signum, handler in handlers.items():
            with contextlib.suppress(OSError, ValueError, TypeError):
                signal.signal(signum, handler)
        command = parse_command(request["argv"])
        if command is None:
            raise ValueError(f"cannot run {request['argv']}")
    except BaseException:  # noqa: BLE001 - reported on the trial's stderr, as a failed start
        traceback.print_exc()
        _exit_as(127)
    supervise(lambda: _run_script(command, handlers), parent=server)


def serve(fd: int, preload: Sequence[str]) -> None:
    """The warm server: import, report ready, then fork one launcher per request until the
    parent's end of the channel closes."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    # A fresh interpreter's handlers, restored in every launcher and script process.
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()
                if s not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(s) is not None}
    refusal = None
    try:
        # What a trial child imports: torch, and the project's layers under load_policy (this
        # package and the top of advisor are imported already, by ``python -m`` of _run).
        import torch

        import policies  # noqa: F401
        import probes  # noqa: F401

        # An optimizer's first step imports Dynamo (seconds: it brings sympy): every trial's.
        with contextlib.suppress(ImportError):
            import torch._dynamo  # noqa: F401
        for name in preload:
            _preload(name)
        gc.collect()
        gc.freeze()  # what the imports built is shared with every fork, untouched by its collector
        _settle()
        refusal = server_refusal(thread_count(), torch.cuda.is_initialized())
    except Exception as exc:  # noqa: BLE001 - the parent starts its trials cold, for this reason
        refusal = f"the warm server's imports failed: {type(exc).__name__}: {exc}"
    if not _send(sock, {"ready": os.getpid(), "refusal": refusal}) or refusal:
        return
    while True:
        request, fds = _receive(sock)
        if request is None:
            return
        if request.get("op") != "run":
            for f in fds:
                os.close(f)
            continue
        refusal = server_refusal(thread_count(), torch.cuda.is_initialized())
        if refusal is not None or len(fds) != 2:
            for f in fds:
                os.close(f)
            _send(sock, {"cold": refusal or "the request came without the trial's stdout and stderr"})
            continue
        pid = os.fork()
        if pid == 0:
            _launcher(sock, request, fds, handlers)
        for f in fds:
            os.close(f)
        _send(sock, {"pid": pid})
        status = _watch(sock, pid)
        if status is None:  # the parent died: nothing of its trial outlives it
            _end(pid)
            return
        _send(sock, {"exit": status})
        # Reaped once the parent has seen the status (its "reap", or its end).
        _receive(sock)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
