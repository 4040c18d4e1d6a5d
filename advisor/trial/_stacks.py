"""Where a timed-out trial hung: its processes dump their stacks on a signal before the kill."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._proctree import live_descendants, process_table

STACK_SIGNAL = "SIGUSR2"  # on which a trial process dumps its stacks (faulthandler)
STACK_PID_PREFIX = "pid "  # a dump file's first line names the process to signal
STACK_WAIT_S = 2.0  # how long the parent waits for the dumps, before the kill


def stack_dump_path(result_path: str | os.PathLike[str]) -> str:
    return f"{os.fspath(result_path)}.stack"


_STACK_FILE: Any = None  # held for the process's lifetime: faulthandler writes to it


def register_stack_dump(result_path: str) -> None:
    """Have ``STACK_SIGNAL`` dump this process's stacks after a ``pid N`` line, where it can."""
    global _STACK_FILE
    sig = getattr(signal, STACK_SIGNAL, None)
    if _STACK_FILE is not None or sig is None:
        return
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        stack_file = open(stack_dump_path(result_path), "w")  # noqa: SIM115 (open for the process's life)
        stack_file.write(f"{STACK_PID_PREFIX}{os.getpid()}\n")
        stack_file.flush()  # faulthandler writes to the descriptor, after the header
        faulthandler.register(sig, file=stack_file, all_threads=True, chain=False)
        _STACK_FILE = stack_file


@dataclass(frozen=True)
class StackFrame:

    file: str
    line: int
    function: str

    @property
    def in_torch(self) -> bool:
        return "/torch/" in self.file.replace(os.sep, "/")

    def __str__(self) -> str:
        return f"{os.path.basename(self.file)} line {self.line} ({self.function})"


_DUMP_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<function>.*)$')
_DUMP_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+ \(most recent call first\):$")


def main_frame(dump: str) -> StackFrame | None:
    """The innermost frame of the main thread in a ``faulthandler`` dump of every thread, or
    ``None``. faulthandler lists threads newest first, so the main thread is the last listed."""
    lines = dump.splitlines()
    starts = [i for i, line in enumerate(lines) if _DUMP_THREAD.match(line.strip())]
    for line in lines[starts[-1] + 1:] if starts else []:
        found = _DUMP_FRAME.match(line)
        if found is not None:
            return StackFrame(found["file"], int(found["line"]), found["function"])
    return None


def stack_blame(dumps: Sequence[str | None]) -> str | None:
    """Which process of a timed-out trial hung, from each one's stack dump (index = rank);
    ``None`` when no dump holds a frame. One in torch's own code waited (in a collective, or
    the autograd engine); one elsewhere hung there."""
    frames = [None if dump is None else main_frame(dump) for dump in dumps]
    if not any(frames):
        return None
    if len(frames) == 1:
        if frames[0] is not None and frames[0].in_torch:
            return f"the script was waiting in torch (a collective or the autograd engine) at {frames[0]}"
        return f"the script hung in {frames[0]}"
    hung = [(rank, frame) for rank, frame in enumerate(frames) if frame is not None and not frame.in_torch]
    waited = [rank for rank, frame in enumerate(frames) if frame is not None and frame.in_torch]
    silent = [rank for rank, frame in enumerate(frames) if frame is None]
    parts = []
    if hung:
        text = "; ".join(f"rank {rank} hung in {frame}" for rank, frame in hung)
        if waited:
            them = "it" if len(hung) == 1 else "them"
            text += f" while {_ranks_text(waited)} waited for {them} in torch"
        parts.append(text)
    else:
        parts.append(f"{'every rank' if not silent else _ranks_text(waited)} waited in torch (a collective or the "
                     "autograd engine), none in the script")
    if silent:
        parts.append(f"{_ranks_text(silent)} dumped no stack")
    return "; ".join(parts)


def _ranks_text(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def request_stack_dumps(paths: Sequence[Path], root: int, *, wait_s: float = STACK_WAIT_S) -> list[str | None]:
    """Ask each trial process below ``root`` that registered a stack dump (``paths``) to write
    it, and read the dumps (``None`` where none came). Only a pid below ``root`` is signalled
    (one that ended may have left its pid to another); waits up to ``wait_s``."""
    sig = getattr(signal, STACK_SIGNAL, None)
    below = set(live_descendants(process_table(), root)) if sig is not None else set()
    headers: dict[int, int] = {}
    for index, path in enumerate(paths):
        # Unreadable, or the process ended (ProcessLookupError) or is not ours: no dump.
        with contextlib.suppress(OSError, UnicodeDecodeError):
            first = path.read_text().partition("\n")[0]
            pid = first[len(STACK_PID_PREFIX):]
            if first.startswith(STACK_PID_PREFIX) and pid.isdigit() and int(pid) in below:
                os.kill(int(pid), sig)  # type: ignore[arg-type]
                headers[index] = len(first) + 1
    deadline, sizes = time.monotonic() + wait_s, {}
    while headers:
        now = {index: paths[index].stat().st_size for index in headers}
        # Every dump is written and none grew since the last look, or the time is up.
        written = all(size > headers[index] for index, size in now.items()) and now == sizes
        if written or time.monotonic() >= deadline:
            break
        sizes = now
        time.sleep(0.05)
    dumps: list[str | None] = [None] * len(paths)
    for index, skip in headers.items():
        with contextlib.suppress(OSError):
            text = paths[index].read_text(errors="replace")[skip:]
            dumps[index] = text if text.strip() else None
    return dumps
