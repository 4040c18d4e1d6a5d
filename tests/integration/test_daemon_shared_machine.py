"""The daemon and the cache on a machine shared with other users: real processes, real files.

Another local user must not be able to run code through the daemon's job queue, redirect its
writes through symlinks, hand the client a token or an address, or read the jobs' secrets.
The other user is ``nobody``: those tests run only as root (``runuser`` switches to it) and
are skipped otherwise.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pwd
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _daemon_server import ROOT, Daemon, copy_scripts, daemon_env

from advisor.cache._store import Store
from advisor.daemon._client import DaemonClient, read_token
from advisor.daemon._server import ensure_token, write_private
from probes import MpadviseError

TINY_TUNE = {"trials": 1, "steps": 32, "warmup": 2, "modes": ["fp32"]}


def _other_user() -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


OTHER = _other_user()
needs_other_user = pytest.mark.skipif(
    os.geteuid() != 0 or OTHER is None or shutil.which("runuser") is None,
    reason="acting as another local user needs root, the user `nobody` and runuser",
)


def as_other_user(*argv: str) -> None:
    """Run a command as ``nobody`` (it must succeed)."""
    subprocess.run(["runuser", "-u", "nobody", "--", *argv], check=True, capture_output=True, timeout=30)


@pytest.fixture
def world_writable() -> Iterator[Path]:
    """A directory every local user may write (mode 0777), outside root's private tmp."""
    path = Path(tempfile.mkdtemp(prefix="mpadvise-shared-", dir="/tmp"))
    path.chmod(0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _daemon_run(home: Path, root: Path, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``mpadvise daemon run`` that is expected to refuse and exit; a daemon that serves fails the test."""
    root.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "advisor.cli", "daemon", "run", "--port", "0",
                             "--allowed-root", str(root)], cwd=ROOT, env=daemon_env(home), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the daemon served on {home} instead of refusing it:\n{err[-2000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _assert_one_line_refusal(result: subprocess.CompletedProcess[str], path: Path) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if str(path) in line]
    assert lines, result.stderr
    assert "MPADVISE_HOME" in lines[0] or "chmod" in lines[0] or "rm " in lines[0], lines[0]


# --------------------------------------------------------------------------------------
# The cache directory and what lies in it


@needs_other_user
def test_daemon_refuses_a_cache_directory_others_can_write(world_writable, tmp_path):
    # Another user prepares the trap before root starts a daemon on the shared directory.
    as_other_user("touch", str(world_writable / "mpadvise.db"))
    as_other_user("chmod", "666", str(world_writable / "mpadvise.db"))
    as_other_user("mkdir", "-m", "777", str(world_writable / "jobs"))
    result = _daemon_run(world_writable, tmp_path / "root")
    _assert_one_line_refusal(result, world_writable)
    assert "writable by others" in result.stderr


@needs_other_user
@pytest.mark.parametrize("planted", ["mpadvise.db", "jobs", "daemon.token", "daemon.log"])
def test_daemon_refuses_files_that_belong_to_someone_else(world_writable, tmp_path, planted):
    home = world_writable / "home"
    home.mkdir()
    home.chmod(0o777)
    target = home / planted
    if planted == "jobs":
        as_other_user("mkdir", "-m", "700", str(target))
    else:
        as_other_user("touch", str(target))
        as_other_user("chmod", "600", str(target))
    home.chmod(0o755)  # root's own directory again, but the other user's file stays in it
    result = _daemon_run(home, tmp_path / "root")
    _assert_one_line_refusal(result, target)
    assert f"uid {OTHER.pw_uid}" in result.stderr


def test_cache_command_refuses_an_unsafe_directory_in_one_line(world_writable):
    result = subprocess.run([sys.executable, "-m", "advisor.cli", "cache", "clear"], cwd=ROOT,
                            env=daemon_env(world_writable), capture_output=True, text=True, timeout=120)
    _assert_one_line_refusal(result, world_writable)
    assert not (world_writable / "mpadvise.db").exists()


def test_files_are_private_and_the_log_keeps_job_arguments_out(tmp_path):
    home, root = tmp_path / "home", tmp_path / "root"
    copy_scripts(root, "tiny_ok.py")
    home.mkdir(mode=0o755)  # as an older version left it
    home.chmod(0o755)
    (home / "daemon.log").write_text("")  # as `daemon start` opens it, under the umask
    (home / "daemon.log").chmod(0o644)
    daemon = Daemon(home, root).start()
    try:
        job = daemon.submit(str(root / "tiny_ok.py"), ["40", "--api-key=hunter2-secret"], **TINY_TUNE)
        daemon.wait_job(job["id"], timeout=300)
    finally:
        daemon.stop()
    assert "hunter2-secret" not in daemon.log()
    assert job["id"] in daemon.log()
    assert stat.S_IMODE(home.stat().st_mode) == 0o700
    assert stat.S_IMODE((home / "jobs").stat().st_mode) == 0o700
    for name in ("mpadvise.db", "mpadvise.db-wal", "mpadvise.db-shm", "daemon.log", "daemon.token",
                 f"jobs/{job['id']}.log"):
        path = home / name
        if path.exists():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, name


# --------------------------------------------------------------------------------------
# Jobs


def test_a_queued_job_outside_the_roots_is_failed_not_run(tmp_path):
    home, root, outside = tmp_path / "home", tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    marker = tmp_path / "ran"
    evil = outside / "evil.py"
    evil.write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    daemon = Daemon(home, root).start()
    try:
        # Written straight into the queue, as anyone able to write the database could.
        with Store(home / "mpadvise.db") as store:
            job_id = store.enqueue_job(script=str(evil), options={**TINY_TUNE, "cwd": str(outside)})
        job = daemon.wait_job(job_id, timeout=120)
    finally:
        daemon.stop()
    assert job["state"] == "failed", job
    assert "outside the allowed roots" in job["result"]["error"]
    assert not marker.exists()


def test_job_files_are_never_opened_through_symlinks(tmp_path):
    home, root = tmp_path / "home", tmp_path / "root"
    copy_scripts(root, "tiny_ok.py")
    # Each file the daemon writes for a job, planted as a link to a file it must not touch: the
    # first job's request and result (removed, then written anew), the second job's log.
    planted = [("request.json", "result.json"), ("log",)]
    victims = {kind: tmp_path / f"victim-{kind}" for kinds in planted for kind in kinds}
    for victim in victims.values():
        victim.write_text("precious\n")
    home.mkdir()
    jobs = home / "jobs"
    jobs.mkdir(mode=0o700)
    with Store(home / "mpadvise.db") as store:
        ids = [store.enqueue_job(script=str(root / "tiny_ok.py"), args=["40"], options=TINY_TUNE) for _ in planted]
    for job_id, kinds in zip(ids, planted):
        for kind in kinds:
            (jobs / f"{job_id}.{kind}").symlink_to(victims[kind])
    daemon = Daemon(home, root).start()
    try:
        done = [daemon.wait_job(job_id, timeout=300) for job_id in ids]
    finally:
        daemon.stop()
    for victim in victims.values():
        assert victim.read_text() == "precious\n", victim
    assert done[0]["state"] == "succeeded", done[0]


def test_write_private_does_not_follow_a_planted_temporary_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    target = tmp_path / "daemon.json"
    (tmp_path / f".daemon.json.{os.getpid()}.tmp").symlink_to(victim)
    write_private(target, '{"pid": 1}\n')
    assert victim.read_text() == "precious\n"
    assert target.read_text() == '{"pid": 1}\n'
    assert stat.S_IMODE(target.stat().st_mode) == 0o600


# --------------------------------------------------------------------------------------
# The client: the token and where it goes


@needs_other_user
def test_a_token_file_of_someone_else_is_refused(tmp_path):
    path = tmp_path / "daemon.token"
    ensure_token(path)
    os.chown(path, OTHER.pw_uid, OTHER.pw_gid)
    with pytest.raises(MpadviseError, match=f"uid {OTHER.pw_uid}"):
        read_token(path)


@contextlib.contextmanager
def _fake_daemon(home: Path, address: dict[str, object], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A ``daemon.json`` and a held ``daemon.lock``, as a running daemon leaves them."""
    home.mkdir(mode=0o700, exist_ok=True)
    ensure_token(home / "daemon.token")
    (home / "daemon.json").write_text(json.dumps(address))
    (home / "daemon.json").chmod(0o600)
    monkeypatch.setenv("MPADVISE_HOME", str(home))
    fd = os.open(home / "daemon.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        os.close(fd)


def test_client_sends_the_token_only_to_a_loopback_address(tmp_path, monkeypatch):
    with _fake_daemon(tmp_path / "home", {"url": "http://192.0.2.10:8757", "pid": 1}, monkeypatch):
        with pytest.raises(MpadviseError, match="not sending the daemon token"):
            DaemonClient.local(need_token=True)
        assert DaemonClient.local().token is None  # reads without the token still go there
    with _fake_daemon(tmp_path / "home2", {"url": "http://127.0.0.1:8757", "pid": 1}, monkeypatch):
        assert DaemonClient.local(need_token=True).token


@needs_other_user
def test_client_sends_the_token_only_to_a_socket_of_its_own(tmp_path, monkeypatch):
    sock_path = tmp_path / "theirs.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(sock_path))
    sock.close()
    os.lchown(sock_path, OTHER.pw_uid, OTHER.pw_gid)
    with _fake_daemon(tmp_path / "home", {"uds": str(sock_path), "pid": 1}, monkeypatch):
        with pytest.raises(MpadviseError, match="not sending the daemon token"):
            DaemonClient.local(need_token=True)
    os.lchown(sock_path, os.geteuid(), os.getegid())
    with _fake_daemon(tmp_path / "home2", {"uds": str(sock_path), "pid": 1}, monkeypatch):
        assert DaemonClient.local(need_token=True).token

