"""Another local user against a running two-rank trial: every port its processes listen on and
every file of its rendezvous, planted with a pickle whose unpickling would leave a marker.

The trial's ranks meet through a FileStore in a 0700 directory (``advisor.trial._ranks``), not
through torchrun's TCPStore, whose agent unpickles the rendezvous state it reads back; gloo's
own sockets listen on loopback only and carry tensor bytes. The planter runs as ``nobody``
(``runuser``), so the test needs root.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from advisor.trial import STORE_ENV
from advisor.trial._proctree import live_descendants, process_table
from advisor.tune._run import ScriptRunner, TrialSettings
from policies import Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"
PLANTER = Path(__file__).resolve().parent / "_store_planter.py"
OTHER_USER = "nobody"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads sockets from /proc/net/tcp"),
    pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                       reason="the planter runs as another user (nobody), which only root can start"),
    pytest.mark.skipif(shutil.which("runuser") is None, reason="runuser starts the planter as nobody"),
]


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with_target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if with_target.startswith("socket:["):
                found.add(with_target[len("socket:["):-1])
    except OSError:
        pass
    return found


def open_files(pid: int) -> set[str]:
    """The regular files process ``pid`` holds open (not deleted ones)."""
    found = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if target.startswith("/") and not target.endswith(" (deleted)") and os.path.isfile(target):
                found.add(target)
    except OSError:
        pass
    return found


def listening(inodes: set[str]) -> list[tuple[str, int]]:
    """``(host, port)`` of every listening TCP socket among ``inodes`` (IPv4 and IPv6)."""
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            address, state, inode = parts[1], parts[3], parts[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            raw, port = address.split(":")
            packed = bytes.fromhex(raw)
            words = b"".join(packed[i:i + 4][::-1] for i in range(0, size, 4))
            found.append((str(ipaddress.ip_address(words)), int(port, 16)))
    return found


def store_paths(pid: int) -> set[str]:
    """The file store a rank's environment names, and the directory that holds it."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return set()
    for entry in environ:
        name, _, value = entry.decode(errors="replace").partition("=")
        if name == STORE_ENV and value:
            return {value, os.path.dirname(value)}
    return set()


def other_user_python() -> tuple[list[str], dict[str, str]] | None:
    """An interpreter with this one's torch that ``nobody`` can run, and its environment: this
    interpreter if ``nobody`` can reach it, else the system's ``python3`` of the same version
    with this environment's site-packages on its path (a venv under /root, mode 0700, is not
    reachable); ``None`` where neither is."""
    import sysconfig

    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    candidates = [([sys.executable], env)]
    system = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if system:
        candidates.append(([system, "-S"], {**env, "PYTHONPATH": sysconfig.get_paths()["purelib"]}))
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for argv, run_env in candidates:
        probe = subprocess.run(
            ["runuser", "-u", OTHER_USER, "--", *argv, "-c",
             "import sys, torch.distributed; print(f'{sys.version_info[0]}.{sys.version_info[1]}')"],
            capture_output=True, text=True, timeout=180, env={**run_env, "HOME": "/tmp"})
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return argv, run_env
    return None


def test_another_user_cannot_plant_a_pickle_in_a_running_two_rank_trial(tmp_path, isolated_home, monkeypatch):
    python = other_user_python()
    if python is None:
        pytest.skip(f"no interpreter with this torch that {OTHER_USER} can run")
    pids, release = tmp_path / "pids", tmp_path / "release"
    pids.mkdir()
    monkeypatch.setenv("DDP_PID_DIR", str(pids))
    monkeypatch.setenv("DDP_RELEASE", str(release))
    runner = ScriptRunner(SCRIPTS / "ddp_waits_for_release.py", [],
                          TrialSettings(warmup_steps=1, measure_steps=4, nproc_per_node=2, timeout=300))
    outcome: list = []
    trial = threading.Thread(target=lambda: outcome.append(runner(Policy(mode="fp32"), "fp32")))
    trial.start()
    attacker = Path(tempfile.mkdtemp(prefix="planter-"))
    try:
        deadline = time.monotonic() + 240
        while len(list(pids.iterdir())) < 2 and trial.is_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(list(pids.iterdir())) == 2, "the ranks never started their process group"
        processes = live_descendants(process_table(), os.getpid())
        inodes = set().union(*(socket_inodes(p) for p in processes))
        ports = listening(inodes)
        files = set().union(*(open_files(p) | store_paths(p) for p in processes))
        assert any(p.endswith("/store") for p in files), files  # the rendezvous is a file store
        # What is reachable at all listens on loopback only (gloo's pairs, GLOO_SOCKET_IFNAME=lo).
        assert all(host in ("127.0.0.1", "::1") for host, _ in ports), ports
        attacker.chmod(0o777)
        marker = attacker / "planted"
        planted = subprocess.run(
            ["runuser", "-u", OTHER_USER, "--", *python[0], str(PLANTER), str(marker),
             *[f"{host}:{port}" for host, port in ports], "--", *sorted(files)],
            capture_output=True, text=True, timeout=180, env={**python[1], "HOME": str(attacker)})
        print(planted.stdout, planted.stderr[-2000:])
        assert planted.returncode == 0, planted.stderr[-2000:]
        for path in sorted(files):
            if path.endswith("/store"):
                assert f"file {path}: PermissionError" in planted.stdout, planted.stdout
        time.sleep(10)  # the time torchrun's agent took to read back a planted state, and more
    finally:
        release.touch()
        trial.join(timeout=300)
    assert outcome and outcome[0].outcome == "ok", outcome and (outcome[0].reason + outcome[0].stderr_tail)
    assert not (attacker / "planted").exists(), "a pickle planted by another user was unpickled by the trial"
    shutil.rmtree(attacker, ignore_errors=True)
