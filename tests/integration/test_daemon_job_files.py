"""What a job leaves behind: its temporary directory is private and goes when the job ends,
however it ends; the job inherits the daemon's environment (how a secret stays out of ``ps``).
"""

from __future__ import annotations

import stat
import time

import pytest
from _daemon_server import Daemon, copy_scripts

from advisor.daemon._jobs import job_pids, job_request, tune_argv

pytestmark = pytest.mark.slow

TINY_TUNE = {"trials": 1, "steps": 32, "warmup": 2, "modes": ["fp32"]}


def _trial_dirs(*roots):
    return [path for root in roots if root.exists() for path in root.rglob("mpadvise-trial-*")]


def test_a_cancelled_job_leaves_no_trial_directory(tmp_path):
    home, root, tmp = tmp_path / "home", tmp_path / "root", tmp_path / "tmp"
    tmp.mkdir()
    copy_scripts(root, "hangs.py")
    daemon = Daemon(home, root, env={"TMPDIR": str(tmp)}).start()
    try:
        job = daemon.submit(str(root / "hangs.py"), timeout=600, **TINY_TUNE)
        daemon.wait_job(job["id"], ("running",), timeout=120, until=lambda _: len(job_pids(job["id"])) >= 2)
        # The trial's temporary directory is in the job's own, 0700, in the daemon's directory.
        private = home / "jobs" / "tmp" / job["id"]
        deadline = time.monotonic() + 60
        while not _trial_dirs(private) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _trial_dirs(private), list(private.rglob("*")) if private.exists() else "no private directory"
        assert stat.S_IMODE(private.stat().st_mode) == 0o700
        assert not _trial_dirs(tmp)
        status, answer, _ = daemon.request("DELETE", f"/jobs/{job['id']}", token=daemon.token)
        assert status == 202, answer
        assert daemon.wait_job(job["id"], timeout=60)["state"] == "cancelled"
        assert not private.exists()
        assert not _trial_dirs(tmp, home)
    finally:
        daemon.stop()
    assert not _trial_dirs(tmp, home)


def test_a_study_url_in_the_daemons_environment_reaches_the_job_but_not_its_arguments(tmp_path, monkeypatch):
    copy_scripts(tmp_path, "tiny_ok.py")
    url = "postgresql://tuner:s3cret-pw@db.example/studies"
    monkeypatch.setenv("MPADVISE_STORAGE", url)
    monkeypatch.delenv("MPADVISE_STORAGE_FILE", raising=False)
    job = {"id": "0123456789abcdef", "script": str(tmp_path / "tiny_ok.py"), "args": ["50"], "options": {}}
    request, _ = job_request(job, "cpu")
    assert request.options.storage == url
    argv = tune_argv(tmp_path / "r.json", tmp_path / "o.json")
    assert not any("s3cret" in part for part in argv)
    monkeypatch.delenv("MPADVISE_STORAGE")
    assert job_request(job, "cpu")[0].options.storage is None


@pytest.mark.parametrize(("attempts", "options", "resumes"), [
    (0, {}, False),  # a first run: the study-kept check applies as for `mpadvise tune`
    (1, {}, True),  # run again after its daemon stopped: its study's trials are its own
    (2, {"fresh": True}, False),  # asked to start afresh every time
])
def test_a_job_run_again_continues_its_own_study(tmp_path, attempts, options, resumes):
    copy_scripts(tmp_path, "tiny_ok.py")
    job = {"id": "0123456789abcdef", "script": str(tmp_path / "tiny_ok.py"), "args": [], "options": options,
           "attempts": attempts}
    request, _ = job_request(job, "cpu")
    assert request.options.resume is resumes
