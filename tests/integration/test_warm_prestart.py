"""A warm server started ahead of the first trial (``WarmLauncher.prestart``): the tune's parent
imports torch and probes while the server imports, and the first trial is forked from it; a
server started in another environment is started again; nothing starts where trials run cold;
and a tune that refuses before its first trial leaves no server behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from importlib import import_module
from pathlib import Path

import pytest
from test_distributed_trials import alive, processes_where

from advisor.trial import WARM_ENV, TrialSpec, WarmLauncher, run_trial, trial_environment
from advisor.tune import ScriptLaunch, TuneOptions, TuneRequest, tune_script
from policies import Policy
from probes import MpadviseError

service = import_module("advisor.tune._service")  # ``advisor.tune`` is also the API function

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="warm trials fork, on Linux")

SCRIPTS = Path(__file__).resolve().parent / "scripts"
TINY = SCRIPTS / "tiny_ok.py"
FIELDS = {"warmup_steps": 1, "measure_steps": 3}


def trial(tmp_path, warm, name="result", env=None):
    spec = TrialSpec(policy=Policy(mode="fp32").to_dict(), result_path=str(tmp_path / f"{name}.json"), **FIELDS)
    return run_trial(TINY, [], spec, timeout=300.0, warm=warm, env=env)


def gated_preload(tmp_path):
    """A module the server imports that waits until ``go`` exists: a server that cannot be
    ready before the test says so, however fast the machine."""
    go = tmp_path / "go"
    (tmp_path / "waits_for_go.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n")
    return go


def _ends(pid: int, within: float = 30.0) -> bool:
    """Whether process ``pid`` ends within ``within`` seconds (a kill is not instant)."""
    deadline = time.monotonic() + within
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def test_prestart_returns_before_the_server_is_ready_and_the_first_trial_is_forked_from_it(
        tmp_path, isolated_home, monkeypatch):
    go = gated_preload(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with WarmLauncher(preload=["waits_for_go"]) as warm:
        # Returns at once: the server cannot be ready until go exists, which only this test writes.
        assert warm.prestart([str(TINY)], env=trial_environment()) is True
        server = warm.server_pid
        assert server is not None and alive(server)
        assert warm.prestart([str(TINY)], env=trial_environment()) is False  # one server
        go.write_text("")
        result = trial(tmp_path, warm)
        assert result.outcome == "ok", result.reason + result.stderr_tail
        assert warm.forked == 1, warm.last_cold_reason
        assert warm.server_pid == server
    assert not alive(server)


def test_a_server_prestarted_in_another_environment_starts_again_in_the_trials(tmp_path, isolated_home):
    other = {**trial_environment(), "OMP_NUM_THREADS": "1" if os.environ.get("OMP_NUM_THREADS") != "1" else "2"}
    with WarmLauncher() as warm:
        assert warm.prestart([str(TINY)], env=other)
        first = warm.server_pid
        result = trial(tmp_path, warm)
        assert result.outcome == "ok", result.reason + result.stderr_tail
        # Forked, not cold: from a server started again in the trial's environment.
        assert warm.forked == 1, warm.last_cold_reason
        assert warm.server_pid not in (None, first)
        assert _ends(first)


def test_nothing_prestarts_where_the_trials_would_start_cold(isolated_home, monkeypatch):
    with WarmLauncher() as warm:
        assert warm.prestart([str(TINY)], env=trial_environment(), nproc_per_node=2) is False
        assert warm.server_pid is None
        monkeypatch.setenv(WARM_ENV, "0")
        assert warm.prestart([str(TINY)], env=trial_environment()) is False
        assert warm.server_pid is None


def _capture_launchers(monkeypatch):
    """Every launcher tune_script prestarts, with its server's pid when it started."""
    started: list[tuple[WarmLauncher, int | None]] = []
    real = service.prestarted_launcher

    def capture(*args, **kwargs):
        launcher = real(*args, **kwargs)
        started.append((launcher, launcher.server_pid))
        return launcher

    monkeypatch.setattr(service, "prestarted_launcher", capture)
    return started


def test_a_tune_starts_its_server_before_the_probe(tmp_path, isolated_home, monkeypatch):
    started = _capture_launchers(monkeypatch)
    seen: list[int | None] = []
    real_profile_for = service.probes.profile_for

    def profile_for(device):
        seen.append(started[0][0].server_pid if started else None)
        return real_profile_for(device)

    monkeypatch.setattr(service.probes, "profile_for", profile_for)
    script = tmp_path / "tiny_ok.py"  # its config file is written beside it
    script.write_text(TINY.read_text())
    options = TuneOptions(trials=1, warmup=1, steps=31, no_cache=True, modes=("fp32",))
    done = tune_script(TuneRequest(script, (), options, ScriptLaunch()))
    assert done.result.reference.result.outcome == "ok"
    (launcher, pid), = started
    assert seen == [pid] and pid is not None  # running while the hardware was probed
    assert launcher.forked >= 1, launcher.last_cold_reason
    assert launcher.server_pid is None and not alive(pid)  # ended with the tune


def test_a_tune_that_refuses_before_its_first_trial_ends_its_server(tmp_path, isolated_home, monkeypatch):
    started = _capture_launchers(monkeypatch)
    options = TuneOptions(trials=1, no_cache=True, out=str(tmp_path / "missing" / "policy.toml"))
    with pytest.raises(MpadviseError):
        tune_script(TuneRequest(TINY, (), options, ScriptLaunch()))
    (launcher, pid), = started
    assert pid is not None and launcher.server_pid is None
    assert _ends(pid)


def _marked_processes(mark: str) -> list[int]:
    """Processes whose environment holds ``MARK=mark``: a tune's server starts in its environment."""
    return processes_where("environ", lambda environ: f"MPADVISE_TEST_MARK={mark}".encode() in environ.split(b"\0"))


def test_the_command_leaves_no_server_when_it_refuses(tmp_path, isolated_home):
    mark = uuid.uuid4().hex
    env = {**os.environ, "MPADVISE_TEST_MARK": mark}
    script = tmp_path / "train.py"
    script.write_text(TINY.read_text())
    done = subprocess.run([sys.executable, "-m", "advisor.cli", "tune", str(script), "--out", str(tmp_path / "missing" / "x.toml")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert all(_ends(pid) for pid in _marked_processes(mark))
