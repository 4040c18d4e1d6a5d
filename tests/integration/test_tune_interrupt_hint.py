"""Ctrl-C during a tune ends it with exit 130 and says how to continue: the study that keeps
its finished trials, and the command line (``mpadvise``, its own options, with --resume) that
continues it; the same tune run again continues it by itself, saying so in one line. A real
subprocess tune sent SIGINT mid-trial."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from advisor.tune import study_status

SCRIPTS = Path(__file__).resolve().parent / "scripts"

pytestmark = pytest.mark.slow



def _sigint_default() -> None:
    """In the tune's process, before Python starts: SIGINT back to its default. A suite started
    in the background (`cmd &` in a script, as CI runners may) hands its children SIGINT
    ignored, and Python then installs no KeyboardInterrupt for it: Ctrl-C would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)

def _complete(home: Path) -> int:
    db = home / "studies.db"
    if not db.exists():
        return 0
    studies = study_status(f"sqlite:///{db}")
    # Trials that measured a candidate: the study's copy of the fp32 reference is not resumed.
    return studies[0]["measured"] if studies else 0


def test_ctrl_c_names_the_study_and_running_the_tune_again_resumes_it(tmp_path, isolated_home):
    script = tmp_path / "train.py"
    script.write_text((SCRIPTS / "tiny_ok.py").read_text())
    env = {**os.environ, "MPADVISE_HOME": str(isolated_home), "COLUMNS": "200"}
    args = ["tune", "train.py", "--trials", "6", "--steps", "32", "--warmup", "2", "--no-priors", "-m", "bf16-mixed",
            "-m", "fp16-mixed", "--no-cache", "--json", "--", "40"]
    # Its own session, as a shell's job: Ctrl-C reaches the whole group, the trial's process too.
    process = subprocess.Popen([sys.executable, "-m", "advisor.cli", *args], cwd=tmp_path, env=env,
                               stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, preexec_fn=_sigint_default)
    deadline = time.monotonic() + 480
    while _complete(isolated_home) < 1 and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    if process.poll() is not None:  # say why it ended, for a run that could not be interrupted
        raise AssertionError(f"the tune ended before a trial could be interrupted (exit {process.returncode}): "
                             f"{process.stderr.read()[-3000:]}")
    assert _complete(isolated_home) >= 1
    os.killpg(process.pid, signal.SIGINT)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr and stdout == ""
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: interrupted; "), stderr
    kept = _complete(isolated_home)
    assert f"{kept} finished trial" in errors[0] and "studies.db" in errors[0] and "train-" in errors[0]
    [hint] = [ln for ln in stderr.splitlines() if ln.startswith("continue with: ")]
    command = shlex.split(hint.removeprefix("continue with: "))
    assert command[0] == "mpadvise"  # a command to paste names the program, never an interpreter's path
    # Its own options, in their declared order, with --resume; its --json; the script's arguments.
    assert command[1:] == ["tune", "train.py", "--trials", "6", "--steps", "32", "--warmup", "2", "--mode",
                           "bf16-mixed", "--mode", "fp16-mixed", "--resume", "--no-cache", "--no-priors", "--json",
                           "--", "40"], hint

    # The same command again, without --resume, continues the interrupted study by itself.
    resumed = subprocess.run([sys.executable, "-m", "advisor.cli", *args], cwd=tmp_path, env=env,
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    said = [ln for ln in resumed.stderr.splitlines() if "resuming study" in ln]
    assert len(said) == 1 and f"{kept} finished trial" in said[0] and "--fresh" in said[0], resumed.stderr
    assert json.loads(resumed.stdout)["trials_resumed"] > 0, resumed.stderr
    assert _complete(isolated_home) >= kept  # nothing deleted


def test_ctrl_c_of_a_study_in_memory_says_nothing_can_be_resumed(tmp_path):
    script = tmp_path / "train.py"
    script.write_text((SCRIPTS / "tiny_ok.py").read_text())
    home = tmp_path / "not-a-directory"
    home.write_text("")  # the cache directory cannot be made: the study is kept in memory
    env = {**os.environ, "MPADVISE_HOME": str(home), "COLUMNS": "200"}
    process = subprocess.Popen(
        [sys.executable, "-m", "advisor.cli", "tune", "train.py", "--trials", "6", "--steps", "32", "--warmup", "2",
         "--no-priors", "-m", "bf16-mixed", "--no-cache", "--json", "--", "40"],
        cwd=tmp_path, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True, preexec_fn=_sigint_default)
    seen = []
    for line in process.stderr:  # the first trial's line: the search is under way
        seen.append(line)
        if line.startswith("  fp32"):
            break
    assert process.poll() is None, "".join(seen)
    os.killpg(process.pid, signal.SIGINT)
    stdout, rest = process.communicate(timeout=120)
    stderr = "".join(seen) + rest
    assert process.returncode == 130, stderr
    errors = [ln for ln in stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "kept in memory, so nothing can be resumed" in errors[0], stderr
    assert "continue with:" not in stderr and "Traceback" not in stderr


def test_what_sqlalchemy_logs_while_cleaning_up_stays_off_the_terminal(tmp_path):
    # A Ctrl-C that stopped a write once left "Error closing cursor" and a traceback on the
    # terminal, beside the one-line "interrupted": SQLAlchemy logs a failed clean-up itself, and
    # with no handler of the program's own Python prints it. The search's storage keeps it off.
    code = (
        "import logging, sys\n"
        "from advisor.tune._study_status import check_storage\n"
        "check_storage(sys.argv[1])\n"
        "try:\n"
        "    raise KeyboardInterrupt\n"
        "except KeyboardInterrupt:\n"
        "    logging.getLogger('sqlalchemy.pool.impl.QueuePool').error('Error closing cursor', exc_info=True)\n"
        "logging.getLogger('other.library').error('a record of another library still shows')\n"
    )
    done = subprocess.run([sys.executable, "-c", code, f"sqlite:///{tmp_path / 'studies.db'}"], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Error closing cursor" not in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert "a record of another library still shows" in done.stderr
