"""A trial's process tree: every process a trial starts stays findable, and ending it ends all.

A script's processes may sit in sessions of their own, or be orphaned (torchrun's workers), so
on Linux a trial runs under this file as its launcher (``launcher_argv``), a child subreaper:
every orphan of the trial is reparented to it, and the tree below it is the whole trial. The
launcher runs as a plain file (``python -I -S _proctree.py COMMAND...``): standard library only."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

PR_SET_CHILD_SUBREAPER = 36  # prctl options (linux/prctl.h)
PR_SET_PDEATHSIG = 1
SIGKILL = int(getattr(signal, "SIGKILL", 9))  # Windows has no SIGKILL; no tree is walked there
SIGSTOP = int(getattr(signal, "SIGSTOP", 19))
KILL_TIMEOUT = 30.0  # seconds a kill waits (a CUDA process can take seconds to exit)

ProcessTable = Mapping[int, tuple[int, str]]  # pid -> (parent pid, state letter of /proc/PID/stat)


def launcher_argv(python: str) -> list[str]:
    """What runs a trial's command under the launcher; empty where there is no subreaper."""
    if not sys.platform.startswith("linux"):
        return []
    # -I -S: no site-packages and no script directory on sys.path, nothing from the environment.
    return [python, "-I", "-S", str(Path(__file__).resolve())]


def descendants(parents: Mapping[int, int], root: int) -> list[int]:
    """Every process below ``root`` (``parents``: pid -> ppid), children before their own."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for child in sorted(children.get(todo.pop(0), [])):
            if child not in found and child != root:
                found.append(child)
                todo.append(child)
    return found


def live_descendants(table: ProcessTable, root: int) -> list[int]:
    parents = {pid: ppid for pid, (ppid, _) in table.items()}
    return [pid for pid in descendants(parents, root) if table[pid][1] not in ("Z", "X", "x")]


def process_table(proc: str | os.PathLike[str] = "/proc") -> dict[int, tuple[int, str]]:
    """Every process's parent and state, from ``/proc``; empty where there is none."""
    table = {}
    with contextlib.suppress(OSError):  # no /proc
        for entry in [e for e in os.listdir(proc) if e.isdigit()]:
            with contextlib.suppress(OSError, ValueError, IndexError):  # ended meanwhile
                with open(os.path.join(proc, entry, "stat")) as f:
                    stat = f.read()
                # The command name is in parentheses and may hold spaces or parentheses itself.
                state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]
                table[int(entry)] = (int(ppid), state)
    return table


def _send(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def kill_tree(root: int, *, timeout: float = KILL_TIMEOUT, table: Callable[[], ProcessTable] = process_table,
              send: Callable[[int, int], None] = _send, sleep: Callable[[float], None] = time.sleep,
              clock: Callable[[], float] = time.monotonic) -> list[int]:
    """SIGKILL every process below ``root`` (not ``root`` itself) and wait until none runs; the
    processes still running when ``timeout`` ran out.

    The tree is frozen first (SIGSTOP, read again until no unstopped process is found): a
    stopped process neither forks nor exits between the reads. Then it is read and killed
    again until nothing below ``root`` runs: a kill is not instant, and a process that forked
    before its stop took effect is caught by the next read."""
    deadline = clock() + timeout
    stopped: set[int] = set()
    while clock() < deadline:
        running = [pid for pid in live_descendants(table(), root) if pid not in stopped]
        if not running:
            break
        for pid in running:
            send(pid, SIGSTOP)
        stopped.update(running)
    while True:
        live = live_descendants(table(), root)
        if not live:
            return []
        for pid in live:
            send(pid, SIGKILL)
        if clock() >= deadline:
            return live
        sleep(0.01)


def end_trial(pid: int) -> None:
    """Kill an unreaped trial in a session of its own: all below it, its group and itself."""
    kill_tree(pid)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, SIGKILL)  # the session's leader's pid is its process group's
    _send(pid, SIGKILL)


def _prctl(option: int, value: int) -> bool:
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0) == 0
    return False


def end_with_parent(sig: int, *, parent: int | None = None) -> None:
    """Have the kernel send ``sig`` to this process when the parent *thread* that started it
    dies (Linux). With ``parent`` (the pid that started this process), a parent that died
    before the call is caught too: ``sig`` is sent at once."""
    if _prctl(PR_SET_PDEATHSIG, sig) and parent is not None and os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _exit_as(code: int) -> NoReturn:
    """End this process as a child whose ``Popen.returncode`` was ``code`` ended."""
    sys.stdout.flush()
    sys.stderr.flush()
    if code >= 0:
        os._exit(code)
    sig = -code
    with contextlib.suppress(ImportError, OSError, ValueError):  # SIGKILL has no handler to reset
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # the command dumped its own core, if any
        signal.signal(sig, signal.SIG_DFL)
    os.kill(os.getpid(), sig)
    os._exit(128 + sig)  # a signal whose default action is not to terminate


def supervise(start: Callable[[], int], *, parent: int | None = None) -> NoReturn:
    """Be a trial's launcher: a child subreaper that starts the command (``start`` returns its
    pid; ``OSError`` exits 127, as a shell does), reaps orphans until it ends, kills what is left
    below, and exits as it did. When ``parent`` dies, the trial's tree is killed too."""
    _prctl(PR_SET_CHILD_SUBREAPER, 1)

    def end_on_signal(signum: int, frame: object) -> NoReturn:
        kill_tree(os.getpid())
        _exit_as(-signum)

    for name in ("SIGTERM", "SIGHUP"):  # SIGKILL cannot be caught: the parent calls kill_tree
        signal.signal(getattr(signal, name), end_on_signal)
    # The process that started the trial killed (a tune ended by SIGKILL): the trial ends too,
    # its whole tree, rather than running on to the end of its window.
    end_with_parent(int(signal.SIGTERM), parent=parent)
    try:
        child = start()
    except OSError as exc:
        print(f"mpadvise: {exc}", file=sys.stderr)
        _exit_as(127)
    while True:
        # Orphans reparented here are reaped as they end, until the command itself ends.
        pid, status = os.wait()
        if pid == child:
            break
    kill_tree(os.getpid())
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    _exit_as(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    started_by = os.getppid()  # first thing: the parent that may die while this one starts
    if len(sys.argv) < 2:
        print(f"usage: python {sys.argv[0]} COMMAND [ARGS...]", file=sys.stderr)
        sys.exit(2)
    # Held until the end: a Popen that is dropped polls, and so reaps, a child that has ended,
    # and its status would never reach the launcher's wait.
    started: list[subprocess.Popen[bytes]] = []

    def start() -> int:
        try:
            started.append(subprocess.Popen(sys.argv[1:]))
        except OSError as exc:
            raise OSError(f"cannot start {sys.argv[1]}: {exc}") from exc
        return started[0].pid

    supervise(start, parent=started_by)
