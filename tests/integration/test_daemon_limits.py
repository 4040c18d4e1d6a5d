"""A real daemon on loopback, against clients that try to exhaust it: idle connections by the
hundred, a header that never ends, a request dribbled byte by byte; and the address checks
of a wildcard bind (``--host ::`` and ``--host 0.0.0.0``).

The assertions are about what the daemon does (answers the owner, refuses, closes, keeps its
memory), never about how fast: the deadlines are generous bounds for a loaded machine.
"""

from __future__ import annotations

import contextlib
import json
import resource
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _daemon_server import ROOT, Daemon, daemon_env

from advisor.daemon._server import MAX_HEADER_BYTES, REQUEST_TIMEOUT_S, connection_limit

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    base = tmp_path_factory.mktemp("daemon-limits")
    home, root = base / "home", base / "root"
    root.mkdir()
    # 1,024 descriptors, as a default login has: where the connections ran out.
    running = Daemon(home, root, nofile=1024).start()
    try:
        yield running
    finally:
        running.stop()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def _closed_by_peer(sock: socket.socket, deadline: float) -> bool:
    """Whether the daemon closes ``sock`` (EOF or reset) before ``deadline``; reads what it sends."""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([sock], [], [], 1.0)
        if not ready:
            continue
        try:
            if not sock.recv(65536):
                return True
        except OSError:
            return True
    return False


def test_the_connection_limit_leaves_descriptors_for_jobs():
    assert connection_limit(1024) <= 1024 // 2
    assert connection_limit(1 << 20) <= 1024
    assert connection_limit(64) >= 1


def test_idle_connections_by_the_hundred_do_not_lock_the_owner_out(daemon):
    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1300:
        pytest.skip("this test process needs 1,300 descriptors for its idle connections")
    idle: list[socket.socket] = []
    try:
        for _ in range(1100):
            try:
                idle.append(socket.create_connection((daemon.host, daemon.port), timeout=30))
            except OSError:
                break  # refused once the backlog is full: the daemon is still the one deciding
        # The owner, with the token, still gets an answer (at once, or once idle ones time out).
        status, data = daemon.get("/jobs")
        assert status == 200, data
        assert daemon.get("/health")[0] == 200
    finally:
        for sock in idle:
            sock.close()
    assert "Too many open files" not in daemon.log()


def test_a_huge_header_is_refused_and_memory_stays_bounded(daemon):
    assert daemon.proc is not None
    before = _rss_kib(daemon.proc.pid)
    sock = socket.create_connection((daemon.host, daemon.port), timeout=30)
    answer = b""
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Filler: ")
        chunk = b"a" * 65536
        sent = 0
        while sent < 200 * 1024 * 1024:
            ready, _, _ = select.select([sock], [], [], 0)
            if ready:
                break
            try:
                sock.sendall(chunk)
            except OSError:
                break
            sent += len(chunk)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and b"\r\n\r\n" not in answer:
            ready, _, _ = select.select([sock], [], [], 1.0)
            if not ready:
                continue
            try:
                got = sock.recv(65536)
            except OSError:
                break
            if not got:
                break
            answer += got
    finally:
        sock.close()
    after = _rss_kib(daemon.proc.pid)
    assert answer.split(b" ")[1:2] in ([b"431"], [b"400"]), answer[:200]
    assert after - before < 50 * 1024, (before, after)
    assert daemon.get("/health")[0] == 200


def test_an_idle_connection_and_a_dribbled_header_are_closed(daemon):
    idle = socket.create_connection((daemon.host, daemon.port), timeout=30)
    dribble = socket.create_connection((daemon.host, daemon.port), timeout=30)
    try:
        deadline = time.monotonic() + REQUEST_TIMEOUT_S + 60
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000:
            try:
                dribble.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            if time.monotonic() > deadline or _closed_by_peer(dribble, time.monotonic() + 0.2):
                closed = True
                break
        assert closed, "a header dribbled byte by byte kept its connection open"
        assert _closed_by_peer(idle, deadline), "a connection that sends nothing stayed open"
    finally:
        idle.close()
        dribble.close()
    assert MAX_HEADER_BYTES >= 8192


# --------------------------------------------------------------------------------------
# Wildcard binds


def test_ipv4_mapped_loopback_clients_of_a_dual_stack_bind_get_the_host_check(tmp_path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this machine")
    root = tmp_path / "root"
    root.mkdir()
    dual = Daemon(tmp_path / "home", root, "--host", "::", "--allow-remote")
    try:
        dual.start()
        assert dual.host == "127.0.0.1"  # reached through IPv4, seen as ::ffff:127.0.0.1
        status, data, _ = dual.request("GET", "/health", headers={"Host": "evil.example"})
        assert status == 400 and "Host" in data["detail"], (status, data)
        assert dual.request("GET", "/jobs", token=dual.token, headers={"Host": "evil.example"})[0] == 400
        assert dual.request("GET", "/jobs", token=dual.token)[0] == 200
    finally:
        dual.stop()


def test_daemon_start_on_all_interfaces_answers(tmp_path):
    home = tmp_path / "home"
    root = tmp_path / "root"
    root.mkdir()
    env = daemon_env(home)

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "advisor.cli", "daemon", *args], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)

    started = cli("start", "--host", "0.0.0.0", "--port", "0", "--allow-remote", "--allowed-root", str(root),
                  "--wait", "60", "--json")
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        assert "Traceback" not in started.stderr
        info = json.loads(started.stdout)
        assert info["host"] == "0.0.0.0"
        status = cli("status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        assert json.loads(status.stdout)["health"]["status"] == "ok"
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            cli("stop")
