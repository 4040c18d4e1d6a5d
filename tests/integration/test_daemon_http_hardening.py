"""``mpadvise daemon`` against other local users, web pages and damaged state: a real daemon on
loopback, real HTTP, real tune jobs.

What is checked: every read but ``/health`` needs the token; the Host check holds for
loopback clients with ``--allow-remote``; a project's own packages do not shadow mpadvise in
a job; a damaged job row, a full queue and growing logs do not stop the daemon; two startup
mistakes end in one line.
"""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _daemon_server import ROOT, Daemon, copy_scripts, daemon_env

from advisor.cache._store import Store
from advisor.cli._daemon import rotate_log
from advisor.daemon._config import MAX_QUEUED_JOBS, DaemonConfig
from advisor.daemon._jobs import prune_job_logs, tune_argv
from probes import MpadviseError

TINY_TUNE = {"trials": 1, "steps": 32, "warmup": 2, "modes": ["fp32"]}
SECRET = "SECRET-abc123"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("daemon-hardening")
    home, root = base / "home", base / "root"
    copy_scripts(root, "tiny_ok.py", "never_loads_policy.py")
    running = Daemon(home, root).start()
    try:
        yield running
    finally:
        running.stop()


# --------------------------------------------------------------------------------------
# Reads need the token


def test_every_read_but_health_needs_the_token(daemon, cli):
    job = daemon.submit(str(daemon.root / "never_loads_policy.py"), ["--wandb-key", SECRET])
    for path in ("/jobs", f"/jobs/{job['id']}", "/hardware", "/recommendations"):
        status, data, headers = daemon.request("GET", path)
        assert status == 401 and headers.get("www-authenticate") == "Bearer", (path, data)
        assert SECRET not in json.dumps(data)
        assert daemon.request("GET", path, token="not-the-token")[0] == 403, path
        assert daemon.request("GET", path, token=daemon.token)[0] == 200, path
    status, health, _ = daemon.request("GET", "/health")
    assert status == 200 and health["status"] == "ok"
    assert SECRET not in json.dumps(health) and str(daemon.root) not in json.dumps(health)
    daemon.wait_job(job["id"], timeout=60)
    # The CLI's own reads send the token.
    report = cli("daemon", "status", "--json", env=daemon_env(daemon.home), timeout=60)
    assert report.returncode == 0, report.stderr
    assert any(j["id"] == job["id"] for j in json.loads(report.stdout)["jobs"])


def test_allow_remote_keeps_the_host_check_for_loopback_clients(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    remote = Daemon(tmp_path / "home", root, "--host", "0.0.0.0", "--allow-remote")
    try:
        remote.start()
        # A page that rebinds its own name to 127.0.0.1 sends its name as the Host.
        status, data, _ = remote.request("GET", "/health", headers={"Host": "evil.example"})
        assert status == 400 and "Host" in data["detail"]
        assert remote.request("GET", "/jobs", token=remote.token, headers={"Host": "evil.example"})[0] == 400
        assert remote.request("GET", "/jobs")[0] == 401
        assert remote.request("GET", "/jobs", token=remote.token)[0] == 200
    finally:
        remote.stop()


# --------------------------------------------------------------------------------------
# A project's packages do not shadow mpadvise


def test_tune_argv_keeps_the_working_directory_off_sys_path():
    argv = tune_argv("/w/r.json", "/w/o.json", python="py")
    assert argv[-2:] == ["/w/r.json", "/w/o.json"]  # the script and its arguments travel in the request
    if sys.version_info >= (3, 11):
        assert argv[:4] == ["py", "-P", "-m", "advisor.tune.job"]
    else:
        assert argv[0] == "py" and argv[1] == "-c" and "del sys.path[0]" in argv[2] and argv[3] == "advisor.tune.job"


@pytest.mark.slow
def test_a_project_with_its_own_advisor_and_probes_packages_runs(daemon):
    project = daemon.root / "project"
    for name in ("advisor", "probes"):
        (project / name).mkdir(parents=True, exist_ok=True)
        (project / name / "__init__.py").write_text("raise ImportError('the project package was imported')\n")
    status, job, _ = daemon.request("POST", "/jobs", {"script": str(daemon.root / "tiny_ok.py"), "args": ["100"],
                                                      "cwd": str(project), "options": TINY_TUNE}, token=daemon.token)
    assert status == 201, job
    finished = daemon.wait_job(job["id"], timeout=180)
    assert finished["state"] == "succeeded", finished
    assert "the project package was imported" not in (finished["log_tail"] or "")


# --------------------------------------------------------------------------------------
# Damaged rows, a full queue, growing logs


def _insert_raw_job(db: Path, job_id: str, args: str) -> None:
    with sqlite3.connect(db) as conn:
        conn.execute(
            "INSERT INTO jobs (id, state, script, args, options, created_at, attempts) "
            "VALUES (?, 'queued', '/nowhere/train.py', ?, '{}', '2000-01-01T00:00:00Z', 0)",
            [job_id, args],
        )
    conn.close()


def test_a_job_row_that_cannot_be_decoded_fails_and_the_queue_goes_on(daemon):
    _insert_raw_job(daemon.home / "mpadvise.db", "badrow0001", "not json [")
    deadline = time.monotonic() + 30
    bad = {}
    while time.monotonic() < deadline:
        status, bad = daemon.get("/jobs/badrow0001")
        assert status == 200, bad
        if bad["state"] == "failed":
            break
        time.sleep(0.2)
    assert bad["state"] == "failed" and "args" in bad["result"]["error"] and "not JSON" in bad["result"]["error"]
    status, listed = daemon.get("/jobs")
    assert status == 200 and any(j["id"] == "badrow0001" and j["state"] == "failed" for j in listed["jobs"])
    assert daemon.get("/health", token=None)[0] == 200
    # The worker is alive: the next job runs.
    job = daemon.submit(str(daemon.root / "never_loads_policy.py"))
    assert daemon.wait_job(job["id"], timeout=60)["state"] == "failed"
    assert daemon.proc.poll() is None


def test_the_queue_is_capped(daemon):
    # Pinned to a slot this daemon does not have, so none of them starts.
    with Store(daemon.home / "mpadvise.db") as store:
        ids = [store.enqueue_job(script="/nowhere/train.py", gpu="cuda:99") for _ in range(MAX_QUEUED_JOBS)]
    try:
        status, data, headers = daemon.request("POST", "/jobs", {"script": str(daemon.root / "tiny_ok.py")},
                                               token=daemon.token)
        assert status == 429 and str(MAX_QUEUED_JOBS) in data["detail"] and headers.get("retry-after")
    finally:
        with Store(daemon.home / "mpadvise.db") as store:
            for job_id in ids:
                store.cancel_job(job_id)
    status, job, _ = daemon.request("POST", "/jobs", {"script": str(daemon.root / "never_loads_policy.py")},
                                    token=daemon.token)
    assert status == 201
    daemon.wait_job(job["id"], timeout=60)


def test_job_logs_are_pruned_to_the_newest(tmp_path):
    for number in range(12):
        log = tmp_path / f"{number:04d}.log"
        log.write_text("x")
        os.utime(log, (1_000_000 + number, 1_000_000 + number))
    (tmp_path / "keep.out").write_text("not a log")
    prune_job_logs(tmp_path, keep=5)
    assert sorted(p.name for p in tmp_path.glob("*.log")) == [f"{n:04d}.log" for n in range(7, 12)]
    assert (tmp_path / "keep.out").exists()


def test_the_daemon_log_is_rotated_at_its_size_limit(tmp_path):
    log = tmp_path / "daemon.log"
    for generation in range(5):
        log.write_text(f"generation {generation}\n" * 100)
        rotate_log(log, max_bytes=100, keep=3)
    assert not log.exists()
    assert [(tmp_path / f"daemon.log.{n}").read_text().split("\n")[0] for n in (1, 2, 3)] == \
        ["generation 4", "generation 3", "generation 2"]
    assert not (tmp_path / "daemon.log.4").exists()
    log.write_text("small\n")
    rotate_log(log, max_bytes=100, keep=3)
    assert log.read_text() == "small\n"


# --------------------------------------------------------------------------------------
# Startup mistakes end in one line


def test_a_bracketed_ipv6_loopback_binds(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    six = Daemon(tmp_path / "home", root, "--host", "[::1]")
    try:
        six.start()
        assert six.host == "::1"
        assert six.get("/health")[0] == 200
        assert "Traceback" not in six.log()
    finally:
        six.stop()


def test_a_stale_socket_that_cannot_be_removed_is_one_line(tmp_path, monkeypatch):
    from advisor.daemon import _server

    sock_path = tmp_path / "mpadvise.sock"
    import socket

    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()

    def refuse(self: Path, missing_ok: bool = False) -> None:
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "unlink", refuse)
    with pytest.raises(MpadviseError) as refused:
        _server._bind(DaemonConfig(uds=sock_path))
    message = str(refused.value)
    assert "\n" not in message and str(sock_path) in message and "Operation not permitted" in message
    assert refused.value.exit_code == 2


def test_an_unresolvable_host_is_one_line(tmp_path):
    env = daemon_env(tmp_path / "home")
    (tmp_path / "root").mkdir()
    result = subprocess.run([sys.executable, "-m", "advisor.cli", "daemon", "run", "--host", "[::1]x",
                             "--allow-remote", "--port", "0", "--allowed-root", str(tmp_path / "root")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and "mpadvise daemon:" not in line]
    assert len(lines) == 1 and "[::1]x" in lines[0], result.stderr
