"""A tune or trial killed by SIGKILL takes its trial along: the trial's launcher, its script,
every rank of a multi-process trial and the warm server end (``PR_SET_PDEATHSIG`` along the
chain, and the warm server's end of its channel), rather than running to the end of their
window."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from advisor.trial._proctree import live_descendants, process_table

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG and /proc are Linux's"),
]


def running(pids: list[int]) -> list[int]:
    """Those of ``pids`` that still run (a zombie has ended)."""
    table = process_table()
    return [pid for pid in pids if pid in table and table[pid][1] not in ("Z", "X", "x")]


@pytest.mark.parametrize(("nproc", "warm"), [(1, "1"), (1, "0"), (2, "1")], ids=["warm", "cold", "two-ranks"])
def test_a_trial_killed_by_sigkill_leaves_no_process_behind(nproc, warm, tmp_path, isolated_home):
    pids = tmp_path / "pids"
    pids.mkdir()
    env = {**os.environ, "SLEEPER_PID_DIR": str(pids), "MPADVISE_WARM_TRIALS": warm}
    cli = subprocess.Popen(
        [sys.executable, "-m", "advisor.cli", "trial", str(SCRIPTS / "sleeps_in_steps.py"), "--mode", "fp32",
         "--nproc-per-node", str(nproc), "--steps", "10000", "--warmup", "1", "--timeout", "600"],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while len(list(pids.iterdir())) < nproc and cli.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(pids.iterdir())) == nproc, "the trial's script never started stepping"
        tree = live_descendants(process_table(), cli.pid)
        scripts = [int(p.read_text()) for p in pids.iterdir()]
        assert set(scripts) <= set(tree)
        os.kill(cli.pid, signal.SIGKILL)
        cli.wait()
        deadline = time.monotonic() + 60  # generous: a loaded machine, and torch processes to tear down
        while running(tree) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert running(tree) == [], f"left running after the trial's parent was killed: {running(tree)}"
    finally:
        for pid in running(tree):  # a failed check leaves nothing behind either
            os.kill(pid, signal.SIGKILL)
        if cli.poll() is None:
            cli.kill()
            cli.wait()
