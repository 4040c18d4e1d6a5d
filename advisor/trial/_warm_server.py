"""The warm server's side of warm trials (``serve``): import torch and the project once, report
ready, then fork one launcher per request, as the cold launch's ``_proctree.py`` launcher is."""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import socket
import sys
import threading
import traceback
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ._proctree import _exit_as, end_trial, end_with_parent, supervise
from ._python_command import PythonCommand, exit_forked, parse_command, prepare_torch, run_as_python
from ._timeline import clear

SERVER_FLAG = "--warm-server"  # python -P -m advisor.trial._run --warm-server FD [PRELOAD...]
PACKET = 1 << 20  # the largest message of the parent and the server
# What a trial's environment may set differently from the server's: the project's own variables,
# never read at import, and the shell's record of the working directory, which the request carries.
PER_TRIAL_PREFIXES: tuple[str, ...] = ("MPADVISE_",)
PER_TRIAL_NAMES: frozenset[str] = frozenset({"PWD", "OLDPWD"})


def is_per_trial(name: str) -> bool:
    return name in PER_TRIAL_NAMES or name.startswith(PER_TRIAL_PREFIXES)


def server_refusal(threads: int, cuda_initialized: bool) -> str | None:
    """Why the server must not fork; ``None`` when it may."""
    if cuda_initialized:
        return "CUDA is initialised in the warm server, and a forked child cannot use it"
    if threads != 1:
        return f"the warm server runs {threads} threads, and a fork copies only one"
    return None


def thread_count() -> int:
    with contextlib.suppress(OSError):
        return len(os.listdir("/proc/self/task"))
    return threading.active_count()


class Channel:
    """One end of the parent's and the server's socket pair: JSON messages, with descriptors."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.fds: list[int] = []  # those that came with the last message

    def send(self, message: Mapping[str, Any], fds: Sequence[int] = ()) -> bool:
        with contextlib.suppress(OSError):
            socket.send_fds(self.sock, [json.dumps(message).encode()], list(fds))
            return True
        return False

    def receive(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next message; ``None`` when the other end is gone; TimeoutError after ``timeout``."""
        # select() retries by itself on EINTR, with the time left (PEP 475).
        ready, _, _ = select.select([self.sock], [], [], timeout)
        if not ready:
            raise TimeoutError
        with contextlib.suppress(OSError):
            data, fds, _, _ = socket.recv_fds(self.sock, PACKET, 4)
            self.fds = list(fds)
            return json.loads(data) if data else None
        return None


def _preload(name: str) -> None:
    """Import ``name`` (``PACKAGE:FRAMEWORK``: its libraries); a failure is left to the trial."""
    package, _, framework = name.partition(":")
    with contextlib.suppress(Exception):  # a preload is an optimisation; the trial says what fails
        module = importlib.import_module(package)
        if framework:
            for library in module.framework_class(framework).detected_by:
                with contextlib.suppress(Exception):
                    importlib.import_module(library)


def _watch(sock: socket.socket, pid: int) -> int | None:
    """The launcher's exit status, left unreaped; ``None`` when the parent's end closed first."""
    pidfd: int | None = None  # an older kernel: poll
    with contextlib.suppress(AttributeError, OSError):
        pidfd = os.pidfd_open(pid)
    try:
        while True:
            watched = [sock] if pidfd is None else [sock, pidfd]
            ready, _, _ = select.select(watched, [], [], 0.05 if pidfd is None else None)
            if sock in ready:  # nothing is asked of a running trial: only the parent's end matters
                try:
                    if not sock.recv(PACKET):
                        return None
                except OSError:
                    return None
            try:
                found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                return -int(signal.SIGKILL)
            if found is not None and found.si_pid != 0:
                return found.si_status if found.si_code == os.CLD_EXITED else -found.si_status
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _run_script(command: PythonCommand, handlers: Mapping[int, Any]) -> int:
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
        # Fresh random state: ``random`` reseeds itself after a fork; numpy's global generator does not.
        if (numpy_random := sys.modules.get("numpy.random")) is not None:
            with contextlib.suppress(Exception):
                numpy_random.seed()
        clear()  # the marks of this trial only
        prepare_torch()  # torch was imported before the fork: marked now
        code = run_as_python(command)
    except BaseException:  # noqa: BLE001 - a fault here is the trial's, reported as a script's would be
        traceback.print_exc()
    exit_forked(code)


def _launcher(sock: socket.socket, request: Mapping[str, Any], fds: list[int], handlers: Mapping[int, Any]) -> NoReturn:
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
    channel = Channel(socket.socket(fileno=fd))
    channel.sock.set_inheritable(False)
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
        # Fork once and let the child end at once. A library may keep a thread pool that it shuts
        # down before any fork (OpenBLAS, under numpy, starts one at import and registers
        # ``pthread_atfork`` handlers for it); after this the server holds only what stays.
        if (pid := os.fork()) == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        refusal = server_refusal(thread_count(), torch.cuda.is_initialized())
    except Exception as exc:  # noqa: BLE001 - the parent starts its trials cold, for this reason
        refusal = f"the warm server's imports failed: {type(exc).__name__}: {exc}"
    if not channel.send({"ready": os.getpid(), "refusal": refusal}) or refusal:
        return
    while (request := channel.receive()) is not None:
        fds = channel.fds
        refusal = server_refusal(thread_count(), torch.cuda.is_initialized())
        pid = os.fork() if refusal is None and len(fds) == 2 else None
        if pid == 0:
            _launcher(channel.sock, request, fds, handlers)
        for f in fds:
            os.close(f)
        if pid is None:
            channel.send({"cold": refusal or "the request came without the trial's stdout and stderr"})
            continue
        channel.send({"pid": pid})
        status = _watch(channel.sock, pid)
        if status is None:  # the parent died: nothing of its trial outlives it
            end_trial(pid)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
            return
        channel.send({"exit": status})
        channel.receive()  # reaped once the parent has seen the status (its "reap", or its end)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
