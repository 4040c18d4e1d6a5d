"""No process a trial starts outlives it: not one in a session of its own whose parent died
first (reparented to init, out of reach of a walk down from the trial), not one left behind
when the script ends by itself, and not one of a launcher killed before its workers. Tiny
scripts without torch; each writes the pid of the process that should have ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from test_distributed_trials import alive  # whether a process runs, zombies not counted

from advisor.trial import TrialSpec, run_trial
from advisor.trial._proctree import launcher_argv

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a child subreaper is Linux's")

# A child in a session of its own starts a sleeper, in a session of its own, and exits at once:
# the sleeper's parent is dead before any kill, as with a double fork.
ORPHAN = """
import subprocess, sys
code = "import subprocess, sys; p = subprocess.Popen(['sleep', '300'], start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid))"
subprocess.Popen([sys.executable, '-c', code, sys.argv[1]], start_new_session=True).wait()
"""
SCRIPTS = {
    "hangs after orphaning a sleeper": ORPHAN + "import time; time.sleep(300)\n",
    # torchrun's agent killed by the OOM killer: its workers are in sessions of their own.
    "dies by SIGKILL, a worker running": """
import os, signal, subprocess, sys
p = subprocess.Popen(['sleep', '300'], start_new_session=True)
open(sys.argv[1], 'w').write(str(p.pid))
os.kill(os.getpid(), signal.SIGKILL)
""",
    "ends, a worker running": """
import subprocess, sys
p = subprocess.Popen(['sleep', '300'], start_new_session=True)
open(sys.argv[1], 'w').write(str(p.pid))
""",
}


@pytest.mark.parametrize("how", list(SCRIPTS))
def test_no_process_of_the_trial_outlives_it(how, tmp_path):
    script, pid_file = tmp_path / "script.py", tmp_path / "pid"
    script.write_text(SCRIPTS[how])
    spec = TrialSpec(policy={"mode": "fp32"}, result_path=str(tmp_path / "result.json"))
    result = run_trial(script, [str(pid_file)], spec, timeout=5)
    pid = int(pid_file.read_text())
    try:
        assert not alive(pid), f"{how}: process {pid} outlived the trial ({result.outcome})"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    # Hung or killed before load_policy(): lost, no verdict on the candidate; ended by itself: no-policy.
    assert result.outcome == ("no-policy" if how.startswith("ends") else "lost")


def test_the_launcher_ends_as_its_command_ended(tmp_path):
    """The exit status, or the signal, reaches the trial's parent as if there were no launcher:
    a SIGKILL tells an OOM kill from a crash."""
    launcher = launcher_argv(sys.executable)
    for command, code in ((["sh", "-c", "exit 3"], 3), (["sh", "-c", "kill -KILL $$"], -signal.SIGKILL),
                          (["sh", "-c", "kill -SEGV $$"], -signal.SIGSEGV), ([str(tmp_path / "missing")], 127)):
        assert subprocess.run([*launcher, *command], capture_output=True).returncode == code, command
