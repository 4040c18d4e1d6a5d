"""Run a command on a pseudo-terminal and answer its ``[y/N]`` question, as a person would."""

from __future__ import annotations

import os
import pty
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path


def answer_on_terminal(argv: Sequence[str], answer: str, *, cwd: Path, env: Mapping[str, str],
                       stdout_too: bool = True, timeout: float = 120) -> tuple[int, str]:
    """Run ``argv`` with a pseudo-terminal as its stdin and stderr (and stdout, with
    ``stdout_too``), type ``answer`` once it asks ``[y/N]`` (or at once if it ends first), and
    return its exit code and everything it wrote to the terminal."""
    leader, follower = pty.openpty()
    process = subprocess.Popen(list(argv), cwd=cwd, env=dict(env), stdin=follower,
                               stdout=follower if stdout_too else subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    seen = b""
    deadline = time.monotonic() + timeout
    while b"[y/N]" not in seen and time.monotonic() < deadline:
        try:
            seen += os.read(leader, 4096)
        except OSError:  # the command ended without asking
            break
    os.write(leader, answer.encode() + b"\n")
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    code = process.wait(timeout=timeout)
    os.close(leader)
    return code, seen.decode(errors="replace")
