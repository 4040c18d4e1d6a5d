"""Trials forked from the warm server behave as trials in a fresh interpreter: the same result
file and outcome, the same classification of every way a script ends, a timeout that kills the
whole tree, no process left behind when the parent dies; and each case that must start cold
does. Real processes throughout; nothing here asserts a speed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from test_daemon import _wait  # polls until a condition holds
from test_distributed_trials import alive  # whether a process runs, zombies not counted

from advisor.frameworks import plan_for
from advisor.trial import WARM_ENV, TrialSpec, WarmLauncher, run_trial
from advisor.tune._run import ScriptRunner, TrialSettings
from policies import Policy

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm trials fork, on Linux")

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"


@pytest.fixture
def warm():
    launcher = WarmLauncher()
    yield launcher
    launcher.close()


def trial(tmp_path, script, *args, warm=None, mode="fp32", timeout=180.0, env=None, name="result", **fields):
    spec = TrialSpec(policy=Policy(mode=mode).to_dict(), result_path=str(tmp_path / f"{name}.json"), **fields)
    return run_trial(script, list(args), spec, timeout=timeout, warm=warm, env=env)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def test_a_warm_trial_gives_what_a_cold_one_gives(tmp_path, isolated_home, warm):
    fields = {"warmup_steps": 2, "measure_steps": 8, "seed": 5}
    cold = trial(tmp_path, SCRIPTS / "tiny_ok.py", name="cold", **fields)
    forked = trial(tmp_path, SCRIPTS / "tiny_ok.py", warm=warm, name="warm", **fields)
    assert warm.forked == 1, warm.last_cold_reason
    assert cold.outcome == forked.outcome == "ok", forked.reason + forked.stderr_tail
    assert forked.losses == cold.losses and len(forked.losses) == 10
    for name in ("user_batch", "global_batch", "samples", "skipped", "workload_fingerprint", "model_signature",
                 "memory_kind", "exit_code"):
        assert getattr(forked, name) == getattr(cold, name), name
    for result in (cold, forked):
        marks = result.timeline
        assert marks["launched"] <= marks["torch_imported"] <= marks["exited"]
    # A second warm trial forks from the same server and gives the same curve again.
    again = trial(tmp_path, SCRIPTS / "tiny_ok.py", warm=warm, name="again", **fields)
    assert warm.forked == 2 and again.losses == cold.losses


GRANDCHILD = """
import os, subprocess, sys, time
import advisor
mp = advisor.load_policy()
code = "import subprocess, sys; p = subprocess.Popen(['sleep', '300'], start_new_session=True); open(sys.argv[1], 'w').write(str(p.pid))"
subprocess.Popen([sys.executable, '-c', code, sys.argv[1]], start_new_session=True).wait()
open(sys.argv[2], 'w').write(f"{os.getpid()} {os.getppid()}")
time.sleep(300)
"""


def test_a_timeout_kills_the_whole_tree(tmp_path, isolated_home, warm):
    script = write(tmp_path, "hangs.py", GRANDCHILD)
    sleeper_file, own_file = tmp_path / "sleeper", tmp_path / "own"
    result = trial(tmp_path, script, str(sleeper_file), str(own_file), warm=warm, timeout=20)
    assert warm.forked == 1, warm.last_cold_reason
    pids = [int(sleeper_file.read_text()), *map(int, own_file.read_text().split())]  # sleeper, script, launcher
    try:
        assert [pid for pid in pids if alive(pid)] == []
    finally:
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    # "lost" where the trial is judged to have timed out before its candidate took effect.
    assert result.outcome in ("timeout", "lost") and "no result within 20 s" in result.reason, result.reason
    assert warm.server_pid is not None and alive(warm.server_pid)  # the server lives on for the next trial


ENDINGS = {
    "exception": ("crashes_midway.py", []),
    "segfault": ("crashes_midway.py", ["segv"]),
    "syntax error": ("syntax_error.py", []),
    "ends without a step": ("ends_without_step.py", []),
    "exit 3 after load_policy": ("<inline>", ["import advisor, sys", "advisor.load_policy()", "sys.exit(3)"]),
    "exit with a message": ("<inline>", ["import advisor, sys", "advisor.load_policy()", "sys.exit('no data here')"]),
    "missing script": ("<missing>", []),
}


@pytest.mark.parametrize("how", list(ENDINGS))
def test_every_ending_is_classified_as_a_cold_trial_s(tmp_path, isolated_home, warm, how):
    name, args = ENDINGS[how]
    if name == "<inline>":
        script, args = write(tmp_path, "ends.py", "\n".join(args) + "\n"), []
    elif name == "<missing>":
        script = tmp_path / "missing.py"
    else:
        script = SCRIPTS / name
    cold = trial(tmp_path, script, *args, name="cold")
    forked = trial(tmp_path, script, *args, warm=warm, name="warm")
    assert warm.forked == 1, warm.last_cold_reason
    assert (forked.outcome, forked.exit_code) == (cold.outcome, cold.exit_code), (forked.reason, forked.stderr_tail)
    assert forked.reason == cold.reason
    last = [r.stderr_tail.strip().splitlines()[-1] for r in (cold, forked)]
    assert last[0] == last[1]


def test_each_case_that_must_start_cold_does(tmp_path, isolated_home, warm, monkeypatch):
    fields = {"warmup_steps": 1, "measure_steps": 3}
    ok = trial(tmp_path, SCRIPTS / "tiny_ok.py", warm=warm, **fields)
    assert ok.outcome == "ok" and warm.forked == 1
    server = warm.server_pid

    # Another value of a variable torch reads at import: cold, and the server stays.
    env = {**os.environ, "OMP_NUM_THREADS": "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2"}
    result = trial(tmp_path, SCRIPTS / "tiny_ok.py", warm=warm, env=env, **fields)
    assert result.outcome == "ok" and warm.forked == 1
    assert "OMP_NUM_THREADS" in warm.last_cold_reason and warm.server_pid == server

    # The switch: every trial cold.
    monkeypatch.setenv(WARM_ENV, "0")
    result = trial(tmp_path, SCRIPTS / "tiny_ok.py", warm=warm, **fields)
    assert result.outcome == "ok" and warm.forked == 1 and WARM_ENV in warm.last_cold_reason
    monkeypatch.delenv(WARM_ENV)

    # Another interpreter than the server's.
    other = os.path.join(os.path.dirname(sys.executable), "python3")
    if os.path.abspath(other) != os.path.abspath(sys.executable) and os.path.exists(other):
        spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / "other.json"), **fields)
        result = run_trial(SCRIPTS / "tiny_ok.py", [], spec, timeout=180, python=other, warm=warm)
        assert result.outcome == "ok" and warm.forked == 1 and "interpreter" in warm.last_cold_reason

    # The server died: this trial and every later one start cold.
    os.kill(server, signal.SIGKILL)
    for _ in range(2):
        result = trial(tmp_path, SCRIPTS / "tiny_ok.py", warm=warm, **fields)
        assert result.outcome == "ok" and warm.forked == 1 and "died" in warm.last_cold_reason


def test_a_server_with_a_second_thread_never_forks(tmp_path, isolated_home):
    (tmp_path / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    with WarmLauncher(preload=["starts_a_thread"]) as warm:
        for _ in range(2):
            result = trial(tmp_path, SCRIPTS / "tiny_ok.py", warm=warm, env=env, warmup_steps=1, measure_steps=3)
            assert result.outcome == "ok", result.reason + result.stderr_tail
            assert warm.forked == 0 and "2 threads" in warm.last_cold_reason
        assert warm.server_pid is None


PARENT = """
import sys
from advisor.trial import TrialSpec, WarmLauncher, run_trial
spec = TrialSpec(policy={"mode": "fp32"}, result_path=sys.argv[2])
run_trial(sys.argv[1], sys.argv[3:], spec, timeout=600, warm=WarmLauncher())
"""

FAMILY = """
import os, sys, time
launcher = os.getppid()
with open(f"/proc/{launcher}/stat") as f:
    server = int(f.read().rsplit(")", 1)[1].split()[1])
open(sys.argv[1] + ".tmp", "w").write(f"{os.getpid()} {launcher} {server}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(600)
"""


def test_no_orphan_when_the_parent_is_killed(tmp_path, isolated_home):
    parent_script, family = write(tmp_path, "parent.py", PARENT), write(tmp_path, "family.py", FAMILY)
    pids_file = tmp_path / "pids"
    parent = subprocess.Popen([sys.executable, str(parent_script), str(family), str(tmp_path / "r.json"),
                               str(pids_file)], cwd=ROOT)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while not pids_file.exists() and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
        assert pids_file.exists(), "the trial never started"
        pids = [int(p) for p in pids_file.read_text().split()]  # script, launcher, server
        assert all(alive(pid) for pid in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [pid for pid in pids if alive(pid)] == []
    finally:
        for pid in [parent.pid, *pids]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_framework_script_runs_warm(tmp_path, isolated_home):
    plan = plan_for(EXAMPLES / "lightning_mlp.py", "lightning")
    settings = TrialSettings(warmup_steps=2, measure_steps=5, framework="lightning", timeout=400)
    with ScriptRunner(EXAMPLES / "lightning_mlp.py", ["--max-steps", "10"], settings, launch=plan.launch) as runner:
        first = runner(Policy(mode="fp32"), "fp32")
        derived = runner.with_measure_steps(6)
        second = derived(Policy(mode="fp32"), "fp32 again")
        assert derived.warm is runner.warm and runner.warm.forked == 2, runner.warm.last_cold_reason
    for result in (first, second):
        assert result.outcome == "ok", result.reason + result.stderr_tail
    assert first.losses[:7] == second.losses[:7]
    assert runner.warm.server_pid is None  # closed with the runner


def test_no_trial_directory_outlives_its_trial(tmp_path, isolated_home, warm, monkeypatch):
    # A runner once held one directory for its life, and so did each runner derived from it (on
    # more steps): the garbage collector removed it whenever such a runner was
    # dropped, and a Ctrl-C arriving then was swallowed ("Exception ignored in: <finalize
    # object>") while the tune went on. Each trial now has its own, removed as it ends.
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def trial_dirs() -> list[Path]:
        return sorted(tmp_path.glob("mpadvise-trial-*"))

    runner = ScriptRunner(SCRIPTS / "tiny_ok.py", ["40"], TrialSettings(warmup_steps=2, measure_steps=8), warm=warm)
    derived = runner.with_measure_steps(16)
    assert trial_dirs() == []
    seen: list[list[Path]] = []
    watcher = threading.Thread(target=lambda: seen.append(_wait(trial_dirs, timeout=60)), daemon=True)
    watcher.start()
    result = derived(Policy(mode="fp32"), "fp32")
    watcher.join(timeout=60)
    assert result.outcome == "ok", result.reason + result.stderr_tail
    assert seen and len(seen[0]) == 1 and seen[0][0].name.startswith("mpadvise-trial-")  # one, while it ran
    assert trial_dirs() == []
    assert runner(Policy(mode="fp32"), "fp32").outcome == "ok" and trial_dirs() == []
