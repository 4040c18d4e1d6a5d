"""``mpadvise daemon``: a real server on loopback, real HTTP, real tune jobs in subprocesses.

Most endpoint tests share one daemon (module scope); tests that start, stop, kill or
restart daemons get their own cache directory. Every daemon is stopped by its fixture or
test, whatever the outcome.
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from _daemon_server import ROOT, Daemon, copy_scripts, daemon_env, pid_alive, seed_recommendations

from advisor.cache._store import Store
from advisor.daemon._client import DaemonClient, read_token
from advisor.daemon._config import check_bind, is_loopback, under_roots
from advisor.daemon._jobs import JOB_TMP, JobRunner, LogTail, Slot, job_pids, job_request, tune_argv
from advisor.daemon._server import ensure_token
from advisor.tune import TuneRequest
from probes import MpadviseError

TINY_TUNE = {"trials": 1, "steps": 32, "warmup": 2, "modes": ["fp32"]}


# --------------------------------------------------------------------------------------
# Pure decisions


@pytest.mark.parametrize("host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost"])
def test_loopback_addresses_bind_without_a_flag(host):
    assert is_loopback(host)
    assert check_bind(host, allow_remote=False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", ""])
def test_other_addresses_need_allow_remote(host):
    assert not is_loopback(host)
    with pytest.raises(MpadviseError, match="--allow-remote") as refused:
        check_bind(host, allow_remote=False)
    assert refused.value.exit_code == 2
    assert "reachable from other machines" in check_bind(host, allow_remote=True)


def test_under_roots_is_by_path_component():
    roots = [Path("/home/ana")]
    assert under_roots(Path("/home/ana"), roots)
    assert under_roots(Path("/home/ana/proj/train.py"), roots)
    assert not under_roots(Path("/home/anabel/train.py"), roots)
    assert not under_roots(Path("/etc/passwd"), roots)


def test_tune_argv_runs_the_job_entry_point_on_its_request_file():
    argv = tune_argv("/jobs/7.request.json", "/jobs/7.result.json", python="py")
    # The interpreter's own flags (-P, or the 3.10 entry) come before the module's arguments;
    # the script's arguments travel in the request file, never on this command line.
    assert argv[0] == "py" and argv[-3:] == ["advisor.tune.job", "/jobs/7.request.json", "/jobs/7.result.json"]


def test_a_job_request_carries_the_slot_the_options_and_the_arguments(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("import advisor\n")
    job = {"script": str(script), "args": ["--lr", "0.1", "; rm -rf /"],
           "options": {"trials": 3, "modes": ["fp32", "bf16-mixed"], "no_cache": True, "memory_limit": "4GiB"}}
    request, cwd = job_request(job, "cuda:1")
    assert cwd == str(tmp_path)
    assert request.args == ("--lr", "0.1", "; rm -rf /") and request.options.device == "cuda:1"
    assert request.options.trials == 3 and request.options.modes == ("fp32", "bf16-mixed")
    assert request.launch.framework is None
    assert TuneRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request


def test_log_tail_keeps_the_last_lines_and_finds_the_error():
    tail = LogTail(max_lines=3)
    for line in ["starting\n", "spinner 1\rspinner 2\n", "\n", "  fp32: ok\n", "error: the script crashed\n",
                 "mpadvise: bye\n"]:
        tail.add(line)
    assert tail.count == 5
    assert tail.lines() == ["  fp32: ok", "error: the script crashed", "mpadvise: bye"]
    assert tail.error_line() == "the script crashed"


def test_token_is_created_private_and_refused_when_readable(tmp_path):
    path = tmp_path / "daemon.token"
    token = ensure_token(path)
    assert len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) == token
    path.chmod(0o644)
    with pytest.raises(MpadviseError, match="chmod 600"):
        read_token(path)


def _fake_python(tmp_path: Path, *, exit_code: int = 3, sleep: float = 0.0, junk: bool = False,
                 result: bool = True) -> Path:
    """An 'interpreter' that stands in for `python -m advisor.tune.job REQUEST RESULT`: one
    progress line, then a result file that quotes its request (``junk``: text on stdout too)."""
    fake = tmp_path / "fake-python"
    fake.write_text(
        f"#!{sys.executable}\n"
        "import json, sys, time\n"
        "request, result = sys.argv[-2:]\n"
        "print('  fp32: ok, 1.00x fp32', file=sys.stderr, flush=True)\n"
        + ("print('{not json at all', flush=True)\n" if junk else "")
        + f"time.sleep({sleep})\n"
        + ("json.dump({'winner': None, 'request': json.load(open(request))}, open(result, 'w'))\n" if result else "")
        + f"sys.exit({exit_code})\n"
    )
    fake.chmod(0o755)
    return fake


def _wait(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def test_runner_waits_until_the_gpu_is_idle(tmp_path):
    idle = threading.Event()
    calls = []

    def busy(slot: Slot) -> list[int]:
        calls.append(slot.name)
        return [] if idle.is_set() else [4242]

    script = tmp_path / "train.py"
    script.write_text("")
    with Store(tmp_path / "mpadvise.db") as store:
        runner = JobRunner(store=store, slots=[Slot("cuda:0", 0, "GPU-0")], jobs_dir=tmp_path / "jobs", busy=busy,
                           python=str(_fake_python(tmp_path)), poll_s=0.05, gpu_poll_s=0.05, idle_poll_s=0.05)
        job_id = store.enqueue_job(script=str(script), args=["x"], options={"trials": 2})
        runner.start()
        try:
            waiting = _wait(lambda: (store.get_job(job_id).get("progress") or {}).get("waiting_for_pids"))
            assert waiting == [4242]
            assert "pid" not in store.get_job(job_id)["progress"]  # nothing started on a busy GPU
            idle.set()
            job = _wait(lambda: (j := store.get_job(job_id))["state"] in ("succeeded", "failed") and j)
        finally:
            runner.stop()
    assert job["state"] == "succeeded", job
    assert job["result"]["exit_code"] == 3  # "no stable policy" is an answer, not a failure
    request = job["result"]["tune"]["request"]
    assert request["options"]["device"] == "cuda:0" and request["args"] == ["x"]
    assert job["progress"]["recent"] == ["  fp32: ok, 1.00x fp32"] and job["progress"]["lines"] == 1
    assert len(calls) >= 2


def test_runner_cancels_a_job_that_waits_for_the_gpu(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    with Store(tmp_path / "mpadvise.db") as store:
        runner = JobRunner(store=store, slots=[Slot("cuda:0", 0, None)], jobs_dir=tmp_path / "jobs",
                           busy=lambda slot: [777], python=str(_fake_python(tmp_path)), poll_s=0.05,
                           gpu_poll_s=0.05, idle_poll_s=0.05)
        job_id = store.enqueue_job(script=str(script))
        runner.start()
        try:
            _wait(lambda: (store.get_job(job_id).get("progress") or {}).get("phase") == "waiting")
            store.cancel_job(job_id)
            runner.cancel(job_id)
            job = _wait(lambda: (j := store.get_job(job_id))["state"] == "cancelled" and j)
        finally:
            runner.stop()
    assert job["result"] is None and "pid" not in job["progress"]


def test_runner_notes_other_processes_that_start_on_its_gpu(tmp_path):
    started = threading.Event()

    def busy(slot: Slot) -> list[int]:
        return [31337] if started.is_set() else []

    script = tmp_path / "train.py"
    script.write_text("")
    with Store(tmp_path / "mpadvise.db") as store:
        runner = JobRunner(store=store, slots=[Slot("cuda:0", 0, None)], jobs_dir=tmp_path / "jobs", busy=busy,
                           python=str(_fake_python(tmp_path, exit_code=0, sleep=1.5)), poll_s=0.05,
                           gpu_poll_s=0.1, idle_poll_s=0.05)
        job_id = store.enqueue_job(script=str(script))
        runner.start()
        try:
            _wait(lambda: (store.get_job(job_id).get("progress") or {}).get("pid"))
            started.set()
            job = _wait(lambda: (j := store.get_job(job_id))["state"] == "succeeded" and j)
        finally:
            runner.stop()
    assert job["progress"]["foreign_gpu_pids"] == [31337]


def _run_one_job(tmp_path: Path, fake: Path) -> dict:
    script = tmp_path / "train.py"
    script.write_text("")
    with Store(tmp_path / "mpadvise.db") as store:
        runner = JobRunner(store=store, slots=[Slot("cpu")], jobs_dir=tmp_path / "jobs", python=str(fake),
                           poll_s=0.05, idle_poll_s=0.05)
        job_id = store.enqueue_job(script=str(script), args=["x"])
        runner.start()
        try:
            return _wait(lambda: (j := store.get_job(job_id))["state"] in ("succeeded", "failed") and j)
        finally:
            runner.stop()


def test_a_job_result_comes_from_its_result_file_not_stdout(tmp_path):
    job = _run_one_job(tmp_path, _fake_python(tmp_path, exit_code=0, junk=True))
    assert job["state"] == "succeeded", job
    assert job["result"]["exit_code"] == 0 and job["result"]["tune"]["winner"] is None
    assert job["result"]["tune"]["request"]["args"] == ["x"]
    # What the process printed is in its log, as its stderr is; the request and result files are
    # gone, and so is the job's private temporary directory (only their common parent is left).
    assert "{not json at all" in job["log_tail"]
    assert sorted(p.name for p in (tmp_path / "jobs").iterdir()) == sorted([f"{job['id']}.log", JOB_TMP])
    assert list((tmp_path / "jobs" / JOB_TMP).iterdir()) == []


def test_a_job_that_writes_no_result_fails_with_its_last_line(tmp_path):
    job = _run_one_job(tmp_path, _fake_python(tmp_path, exit_code=0, result=False))
    assert job["state"] == "failed" and job["result"] == {"exit_code": 0, "error": "  fp32: ok, 1.00x fp32"}


# --------------------------------------------------------------------------------------
# One shared daemon for the endpoint tests


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    base = tmp_path_factory.mktemp("daemon-shared")
    home, root = base / "home", base / "root"
    copy_scripts(root, "tiny_ok.py", "hangs.py", "never_loads_policy.py")
    home.mkdir()
    seed_recommendations(home, 30)
    daemon = Daemon(home, root).start()
    try:
        yield daemon
    finally:
        daemon.stop()


def test_health_hardware_and_openapi(shared):
    status, health = shared.get("/health")
    assert status == 200 and health["status"] == "ok" and health["pid"] == shared.proc.pid
    assert [slot["name"] for slot in health["slots"]] == ["cpu"]
    status, hardware = shared.get("/hardware")
    assert status == 200 and hardware["slots"][0]["name"] == "cpu"
    assert hardware["primary"] in [d["fingerprint"] for d in hardware["devices"]]
    assert "fp32" in hardware["devices"][-1]["modes"]
    status, schema = shared.get("/openapi.json")
    assert status == 200
    assert {"/health", "/hardware", "/recommendations", "/jobs", "/jobs/{job_id}"} <= set(schema["paths"])
    assert {"get", "post"} <= set(schema["paths"]["/jobs"]) and {"get", "delete"} <= set(schema["paths"]["/jobs/{job_id}"])
    assert schema["paths"]["/jobs"]["post"]["security"]  # the token is declared


def test_token_files_are_private(shared):
    assert stat.S_IMODE((shared.home / "daemon.token").stat().st_mode) == 0o600
    assert int((shared.home / "daemon.pid").read_text()) == shared.proc.pid


def test_reads_and_changes_need_the_token(shared):
    script = str(shared.root / "never_loads_policy.py")
    body = {"script": script, "options": TINY_TUNE}
    for method, path in (("GET", "/jobs"), ("GET", "/recommendations"), ("GET", "/hardware")):
        assert shared.request(method, path)[0] == 401, path
        assert shared.request(method, path, token=shared.token)[0] == 200, path
    assert shared.request("GET", "/health")[0] == 200
    status, data, headers = shared.request("POST", "/jobs", body)
    assert status == 401 and headers.get("www-authenticate") == "Bearer" and "daemon.token" in data["detail"]
    assert shared.request("POST", "/jobs", body, token="not-the-token")[0] == 403
    assert shared.request("POST", "/jobs", body, headers={"Authorization": "Basic dTpw"})[0] == 401
    assert shared.get("/jobs")[1]["count"] == 0  # none of those queued anything
    status, job, headers = shared.request("POST", "/jobs", body, token=shared.token)
    assert status == 201 and headers["location"] == f"/jobs/{job['id']}"
    assert job["state"] in ("queued", "running") and job["script"] == script
    assert shared.request("DELETE", f"/jobs/{job['id']}")[0] == 401
    assert shared.request("DELETE", f"/jobs/{job['id']}", token="wrong")[0] == 403
    finished = shared.wait_job(job["id"], timeout=60)
    # A script that never calls load_policy(): the tune fails, and the job says why.
    assert finished["state"] == "failed" and "load_policy" in finished["result"]["error"]
    assert finished["result"]["exit_code"] == 1 and "load_policy" in finished["log_tail"]
    status, data, _ = shared.request("DELETE", f"/jobs/{job['id']}", token=shared.token)
    assert status == 409 and "already finished" in data["detail"]


def test_recommendations_filters(shared):
    status, data = shared.get("/recommendations")
    assert status == 200 and data["count"] == 30 and len(data["recommendations"]) == 30
    assert "trials" not in data["recommendations"][0]
    assert shared.get("/recommendations?script=train_7.py")[1]["count"] == 1
    assert shared.get("/recommendations?script=/work/train_7.py")[1]["recommendations"][0]["workload_fp"] == f"{7:016x}"
    only = shared.get(f"/recommendations?workload={3:016x}&trials=true")[1]
    assert only["count"] == 1 and only["recommendations"][0]["trials"][0]["mode"] == "fp32"
    assert shared.get("/recommendations?hardware=testhardware0001&limit=5")[1]["count"] == 30
    assert len(shared.get("/recommendations?limit=5")[1]["recommendations"]) == 5
    assert shared.get("/recommendations?hardware=elsewhere")[1]["count"] == 0
    assert shared.get("/recommendations?workload=not-hex")[0] == 422
    assert shared.get("/recommendations?limit=0")[0] == 422


def _post(shared, body=None, raw=None, headers=None):
    status, data, _ = shared.request("POST", "/jobs", body, raw=raw, token=shared.token, headers=headers)
    return status, data


def test_bad_requests_are_refused_with_a_reason(shared):
    ok = str(shared.root / "tiny_ok.py")
    outside = shared.root.parent / "outside.py"
    outside.write_text("print('not allowed')\n")
    jobs_before = shared.get("/jobs")[1]["count"]
    cases = [
        ({"raw": b'{"script": '}, 422, "json"),  # malformed JSON
        ({"raw": b"\xff\xfe not json"}, 400, "parsing the body"),
        ({"body": {"script": ok, "options": {"trials": "many"}}}, 422, "trials"),
        ({"body": {"script": ok, "options": {"trials": 0}}}, 422, "trials"),
        ({"body": {"script": ok, "options": {"trials": True}}}, 422, "trials"),
        ({"body": {"script": ok, "options": {"timeout": -1}}}, 422, "timeout"),
        ({"body": {"script": ok, "args": "--lr 0.1"}}, 422, "args"),  # a string, not a list
        ({"body": {"script": ok, "args": [1, 2]}}, 422, "args"),
        ({"body": {"script": ok, "args": ["x"] * 300}}, 422, "args"),
        ({"body": {"script": ok, "shell": "rm -rf /"}}, 422, "shell"),  # unknown fields are refused
        ({"body": {"script": ok, "options": {"modes": ["no-such-mode"]}}}, 422, "unknown mode"),
        ({"body": {"script": ok, "options": {"modes": ["../../x"]}}}, 422, "modes"),
        ({"body": {"script": ok, "options": {"memory_limit": "lots"}}}, 422, "memory_limit"),
        ({"body": {"script": ok, "gpu": "cuda:7"}}, 422, "not a slot"),
        ({"body": {"script": ok, "args": ["a\u0000b"]}}, 422, "NUL"),
        ({"body": {"script": "tiny_ok.py"}}, 422, "not absolute"),
        ({"body": {"script": str(shared.root / "missing.py")}}, 422, "does not exist"),
        ({"body": {"script": str(shared.root)}}, 422, "not a file"),
        ({"body": {"script": str(outside)}}, 403, "outside the allowed roots"),
        ({"body": {"script": f"{shared.root}/../outside.py"}}, 403, "outside the allowed roots"),
        ({"body": {"script": "/etc/passwd"}}, 403, "outside the allowed roots"),
        ({"body": {"script": ok, "cwd": "/"}}, 403, "outside the allowed roots"),
        ({"body": {"script": ok, "options": {"out": "/tmp/elsewhere.toml"}}}, 403, "outside"),
    ]
    for kwargs, expected, words in cases:
        status, data = _post(shared, **kwargs)
        assert status == expected, (kwargs, status, data)
        assert words.lower() in json.dumps(data).lower(), (kwargs, data)
    # A symlink inside the root that points outside it is judged by its target.
    link = shared.root / "link.py"
    link.symlink_to(outside)
    assert _post(shared, {"script": str(link)})[0] == 403
    assert shared.get("/jobs")[1]["count"] == jobs_before  # nothing refused was queued


def test_size_limits_and_hosts(shared):
    big = {"script": str(shared.root / "tiny_ok.py"), "args": ["x" * 4000] * 20}
    status, data = _post(shared, big)
    assert status == 413 and "65536" in data["detail"]
    # Chunked, so no Content-Length announces the size: still refused, not buffered forever.
    conn = http.client.HTTPConnection(shared.host, shared.port, timeout=30)
    try:
        conn.putrequest("POST", "/jobs")
        conn.putheader("Authorization", f"Bearer {shared.token}")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        chunk = b" " * 16384
        try:
            for _ in range(6):
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon answered and closed before the last chunk: what is asked of it
        response = conn.getresponse()
        assert response.status == 413
    finally:
        conn.close()
    assert shared.request("GET", "/health", headers={"Host": "evil.example:80"})[0] == 400
    assert shared.request("GET", "/health", headers={"Host": f"localhost:{shared.port}"})[0] == 200
    status, data, headers = shared.request("PUT", "/jobs", {})
    assert status == 405 and headers["allow"] == "GET, POST"
    assert shared.get("/jobs/0123456789abcdef")[0] == 404
    assert shared.request("DELETE", "/jobs/nope", token=shared.token)[0] == 404
    assert shared.get("/jobs?state=bogus")[0] == 422


def test_cancel_a_queued_and_a_running_job(shared):
    hang = shared.submit(str(shared.root / "hangs.py"), timeout=600, **TINY_TUNE)
    running = shared.wait_job(hang["id"], ("running",), timeout=60,
                              until=lambda job: len(job_pids(job["id"])) >= 2)  # the tune and its trial
    pids = job_pids(hang["id"])
    assert (running["progress"] or {}).get("pid") in pids
    queued = shared.submit(str(shared.root / "tiny_ok.py"), ["50"], **TINY_TUNE)
    assert shared.get(f"/jobs/{queued['id']}")[1]["state"] == "queued"
    assert shared.get("/health")[1]["jobs"] == {"queued": 1, "running": 1, "cancelling": 0}
    status, job, _ = shared.request("DELETE", f"/jobs/{queued['id']}", token=shared.token)
    assert status == 200 and job["state"] == "cancelled"
    status, job, _ = shared.request("DELETE", f"/jobs/{hang['id']}", token=shared.token)
    assert status == 202 and job["state"] == "cancelling"
    assert shared.wait_job(hang["id"], timeout=30)["state"] == "cancelled"
    # The trial ran in a session of its own: it is gone too, not orphaned.
    _wait(lambda: not any(pid_alive(pid) for pid in pids))
    listed = shared.get("/jobs?state=cancelled")[1]
    assert {j["id"] for j in listed["jobs"]} == {hang["id"], queued["id"]}


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_daemon", ROOT / "scripts" / "bench_daemon.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_load_get_recommendations(shared):
    paths = ["/recommendations", "/recommendations?script=train_1.py", f"/recommendations?workload={2:016x}"]
    bench = _bench_module()
    result = bench.load(shared.host, shared.port, paths, requests=2000, clients=4, max_seconds=60, token=shared.token)
    print(f"\nGET /recommendations x{result['requests']}, 4 clients: {result['requests_per_s']:.0f} req/s, "
          f"p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms")
    assert result["errors"] == 0, result["first_errors"]
    assert result["requests"] == 2000


# --------------------------------------------------------------------------------------
# Daemons of their own


def test_non_loopback_bind_is_refused(tmp_path, cli):
    env = daemon_env(tmp_path / "home")
    for command in (("daemon", "run", "--host", "0.0.0.0"), ("daemon", "start", "--host", "10.1.2.3")):
        result = cli(*command, env=env, timeout=60)
        assert result.returncode == 2, result
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "--allow-remote" in lines[0], result.stderr
        assert "Traceback" not in result.stderr
    assert not (tmp_path / "home" / "daemon.json").exists()


def test_allow_remote_binds_with_a_warning(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    daemon = Daemon(tmp_path / "home", root, "--host", "0.0.0.0", "--allow-remote")
    try:
        daemon.start()
        assert "reachable from other machines" in daemon.log()
        assert daemon.get("/health")[0] == 200  # this test only ever connects through the loopback
    finally:
        daemon.stop()


def test_unix_socket_is_private(tmp_path):
    home, sock = tmp_path / "home", tmp_path / "run" / "mpadvise.sock"
    sock.parent.mkdir()
    (tmp_path / "root").mkdir()
    out = open(tmp_path / "out.txt", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "advisor.cli", "daemon", "run", "--uds", str(sock),
                             "--allowed-root", str(tmp_path / "root")], cwd=ROOT, env=daemon_env(home),
                            stdout=out, stderr=out)
    try:
        _wait(lambda: (home / "daemon.json").exists() and "uds" in json.loads((home / "daemon.json").read_text()),
              timeout=60)
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        client = DaemonClient(uds=str(sock), token="wrong")
        assert client.health()["status"] == "ok"
        status, data = client.request("POST", "/jobs", {"script": "/x"})
        assert status == 403
    finally:
        proc.terminate()
        proc.wait(30)
        out.close()
    assert not sock.exists()


@pytest.mark.slow
def test_cli_start_submit_status_stop(tmp_path, cli):
    home, root = tmp_path / "home", tmp_path / "root"
    copy_scripts(root, "tiny_ok.py")
    env = daemon_env(home)
    started = cli("daemon", "start", "--port", "0", "--allowed-root", str(root), "--json", env=env, timeout=90)
    try:
        assert started.returncode == 0, started.stderr
        info = json.loads(started.stdout)
        assert info["slots"] == ["cpu"] and info["url"].startswith("http://127.0.0.1:")
        assert int((home / "daemon.pid").read_text()) == info["pid"] and pid_alive(info["pid"])
        assert stat.S_IMODE((home / "daemon.token").stat().st_mode) == 0o600
        again = cli("daemon", "start", "--port", "0", env=env, timeout=60)
        assert again.returncode == 1 and "already running" in again.stderr

        tuned = cli("tune", "--submit", str(root / "tiny_ok.py"), "--trials", "1", "--steps", "32", "--warmup", "2",
                        "--mode", "fp32", "--json", "--", "100", env=env, timeout=180, cwd=root)
        assert tuned.returncode == 0, tuned.stderr
        assert "queued job" in tuned.stderr and "fp32: ok" in tuned.stderr  # progress followed
        result = json.loads(tuned.stdout)  # exactly what `mpadvise tune --json` prints
        assert result["winner_label"] == "fp32" and result["cache_id"] is not None
        assert Path(result["config_file"]) == root / "tiny_ok.mpadvise.toml"

        status = cli("daemon", "status", "--json", env=env, timeout=60)
        assert status.returncode == 0, status.stderr
        report = json.loads(status.stdout)
        assert report["running"] and report["jobs"][-1]["state"] == "succeeded"
        assert report["jobs"][-1]["result"]["tune"]["cache_id"] == result["cache_id"]
        # It landed in the cache, as `mpadvise tune` stores it.
        port = info["port"]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        token = (home / "daemon.token").read_text().strip()
        conn.request("GET", "/recommendations?script=tiny_ok.py", headers={"Authorization": f"Bearer {token}"})
        cached = json.loads(conn.getresponse().read())
        conn.close()
        assert cached["count"] == 1
        entry = cached["recommendations"][0]
        assert entry["id"] == result["cache_id"] and entry["script"] == str(root / "tiny_ok.py")
        assert entry["workload_fp"] == result["winner"]["tuned_on"]["workload_fingerprint"]
        human = cli("daemon", "status", env=env, timeout=60)
        assert human.returncode == 0 and "winner fp32" in human.stdout
    finally:
        stopped = cli("daemon", "stop", env=env, timeout=60)
    assert stopped.returncode == 0 and "stopped" in stopped.stdout, stopped.stderr
    assert not (home / "daemon.pid").exists() and not (home / "daemon.json").exists()
    gone = cli("daemon", "status", env=env, timeout=60)
    assert gone.returncode == 1 and "no mpadvise daemon is running" in gone.stderr and "Traceback" not in gone.stderr
    assert "nothing to stop" in cli("daemon", "stop", env=env, timeout=60).stdout
    refused = cli("tune", "--submit", str(root / "tiny_ok.py"), env=env, timeout=60)
    assert refused.returncode == 1 and "daemon start" in refused.stderr


@pytest.mark.slow
def test_restart_runs_the_queued_job_and_the_interrupted_one_again(tmp_path):
    home, root = tmp_path / "home", tmp_path / "root"
    copy_scripts(root, "hangs.py", "never_loads_policy.py")
    first = Daemon(home, root).start()
    try:
        hang = first.submit(str(root / "hangs.py"), timeout=600, **TINY_TUNE)
        first.wait_job(hang["id"], ("running",), timeout=60, until=lambda job: len(job_pids(job["id"])) >= 2)
        pids = job_pids(hang["id"])
        queued = first.submit(str(root / "never_loads_policy.py"), **TINY_TUNE)
    finally:
        assert first.stop() == 0  # a graceful stop
    assert not any(pid_alive(pid) for pid in pids)  # it took its running job down with it
    second = Daemon(home, root).start()
    try:
        again = second.wait_job(hang["id"], ("running",), timeout=60)
        assert again["attempts"] == 1
        assert second.get(f"/jobs/{queued['id']}")[1]["state"] == "queued"
        assert second.request("DELETE", f"/jobs/{hang['id']}", token=second.token)[0] == 202
        ran = second.wait_job(queued["id"], timeout=90)
        assert ran["state"] == "failed" and "load_policy" in ran["result"]["error"]
        assert second.get(f"/jobs/{hang['id']}")[1]["state"] == "cancelled"
    finally:
        second.stop()


@pytest.mark.slow
def test_restart_after_a_hard_kill_requeues_the_running_job_once(tmp_path):
    home, root = tmp_path / "home", tmp_path / "root"
    copy_scripts(root, "tiny_ok.py")
    home.mkdir()
    # A job that was running when a daemon died and has already used its one retry, as a
    # second crash leaves it.
    with Store(home / "mpadvise.db") as store:
        spent = store.enqueue_job(script=str(root / "tiny_ok.py"), args=["100"], options=TINY_TUNE)
        store.claim_next_job("cpu")
        store.requeue_interrupted()
        assert store.claim_next_job("cpu")["attempts"] == 1
    first = Daemon(home, root).start()
    try:
        assert first.get(f"/jobs/{spent}")[1]["state"] == "interrupted"
        job = first.submit(str(root / "tiny_ok.py"), ["100"], **TINY_TUNE)
        first.wait_job(job["id"], ("running",), timeout=60, until=lambda j: len(job_pids(j["id"])) >= 2)
        orphans = job_pids(job["id"])
    finally:
        first.kill()
    # Killed with -9, the daemon left its tune behind (in its own process group).
    assert any(pid_alive(pid) for pid in orphans)
    second = Daemon(home, root).start()
    try:
        assert not any(pid_alive(pid) for pid in orphans)  # killed before the job ran again
        done = second.wait_job(job["id"], timeout=120)
        assert done["state"] == "succeeded" and done["attempts"] == 1, done
        cached = second.get("/recommendations?script=tiny_ok.py")[1]
        assert cached["count"] == 1 and cached["recommendations"][0]["id"] == done["result"]["tune"]["cache_id"]
    finally:
        second.stop()


# Every check but two that do not fit this API:
# - use_after_free: DELETE /jobs/{id} cancels a job and keeps its record (GET then shows it
#   cancelled), by design;
# - positive_data_acceptance: a schema-valid job still needs a script that exists under the
#   allowed root, which no schema can say.
EXCLUDED_CHECKS = "use_after_free,positive_data_acceptance"
# 413 is the right refusal for an oversized body (5xx is left to not_a_server_error).
SCHEMATHESIS_CONFIG = """
[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429"]
"""


@pytest.mark.slow
def test_schemathesis_finds_no_server_error(tmp_path):
    root = tmp_path / "root"  # empty: no generated job can name a real script
    root.mkdir()
    config = tmp_path / "schemathesis.toml"
    config.write_text(SCHEMATHESIS_CONFIG)
    daemon = Daemon(tmp_path / "home", root).start()
    try:
        st = Path(sys.executable).with_name("st")
        result = subprocess.run(
            [str(st), "--config-file", str(config), "run", f"http://{daemon.host}:{daemon.port}/openapi.json",
             "-H", f"Authorization: Bearer {daemon.token}", "--checks", "all", "--exclude-checks", EXCLUDED_CHECKS, "--max-examples", "25",
             "--seed", "7", "--generation-database", "none", "--no-color", "--request-timeout", "10",
             "--report-dir", str(tmp_path / "report")],
            capture_output=True, text=True, timeout=150, cwd=tmp_path, env=dict(os.environ, NO_COLOR="1"),
        )
        assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
        assert daemon.proc.poll() is None
        assert "Traceback" not in daemon.log()
    finally:
        daemon.stop()
