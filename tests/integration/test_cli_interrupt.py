"""Ctrl-C at any moment of a command line, from the first import on, is one line on stderr and
exit 130: never Python's KeyboardInterrupt traceback, never a death by the signal.

``import advisor`` loads nothing heavy, and the console script's ``main`` catches Ctrl-C before
typer, rich and the tune are imported. Each case starts the command as the console script does
(``from advisor.cli import main; main()``) and sends SIGINT at a few moments after ``main`` began
importing the command line, which a small audit hook in the child reports through a pipe: the
moments are counted from there, not from the interpreter's own start-up, so a loaded machine
moves where each signal lands but not what must come of it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"

# The console script's two lines, after a hook that writes one byte to the pipe ``{fd}`` when
# ``main`` starts importing the command line (``advisor.cli._app``).
_LAUNCH = """\
import os, sys
def _report(event, args, fd=[{fd}]):
    if fd and event == "import" and args[0] == "advisor.cli._app":
        os.write(fd.pop(), b".")
sys.addaudithook(_report)
sys.argv[0] = "mpadvise"
from advisor.cli import main
main()
"""

DELAYS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.3)


def _sigint_default() -> None:
    """SIGINT back to its default in the child: a suite started in the background hands its
    children SIGINT ignored, and Python then installs no KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(args: list[str], delay: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run ``mpadvise ARGS``, send SIGINT ``delay`` seconds after ``main`` began its imports."""
    read_end, write_end = os.pipe()
    env = {**os.environ, "COLUMNS": "120", "MPADVISE_HOME": str(cwd / "home")}
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", _LAUNCH.format(fd=write_end), *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, pass_fds=(write_end,),
            preexec_fn=_sigint_default)
    finally:
        os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as started:
            assert started.read(1) == b".", "the command line was never imported"
        time.sleep(delay)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _check(result: subprocess.CompletedProcess[str]) -> None:
    lines = result.stderr.splitlines()
    assert "Traceback" not in result.stderr and "KeyboardInterrupt" not in result.stderr, result.stderr
    assert result.returncode == 130, (result.returncode, result.stderr[-2000:])
    assert len(lines) == 1 and "interrupted" in lines[0], result.stderr


@pytest.mark.parametrize("delay", DELAYS)
def test_ctrl_c_while_the_help_loads_is_one_line_and_exit_130(tmp_path, delay):
    result = _interrupt(["--help"], delay, tmp_path)
    if result.returncode == 0:  # the help was printed in full before the signal came
        assert "Usage" in result.stdout and not result.stderr, result.stderr
        return
    _check(result)


@pytest.mark.parametrize("delay", (0.0, 0.1, 0.3))
def test_ctrl_c_while_a_tune_starts_is_one_line_and_exit_130(tmp_path, delay):
    script = tmp_path / "train.py"
    script.write_text((SCRIPTS / "tiny_ok.py").read_text())
    # A tune imports torch and probes the machine first: every moment here falls before a trial.
    _check(_interrupt(["tune", "train.py", "--trials", "2", "--steps", "32", "--no-cache", "--quiet", "--", "40"],
                      delay, tmp_path))


def test_import_advisor_loads_nothing_heavy():
    heavy = ("advisor.tune", "advisor._load", "advisor.runtime", "policies", "typer", "rich", "torch")
    code = f"import sys, advisor; print(sorted(m for m in {heavy!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stdout + result.stderr
