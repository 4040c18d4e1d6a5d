"""Load test of ``mpadvise daemon``: GET /recommendations on loopback, requests/s and latency.

Starts ``mpadvise daemon run --port 0`` on a temporary cache directory seeded with
``--entries`` recommendations, then sends ``--requests`` GETs from ``--clients`` threads, each
on one keep-alive connection (as a long-lived client would), and stops after ``--max-seconds``
whatever happens. The queries rotate over: no filter, a script filter that matches one entry,
and a workload filter. Prints a table and, with ``--json``, writes the numbers.

The client runs on the same machine as the server, so on a small machine the two share the
cores: the numbers are a floor for what a separate client would see.

    .venv/bin/python scripts/bench_daemon.py [--requests 5000] [--clients 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from probes import write_file_atomic

ROOT = Path(__file__).resolve().parents[1]
TARGET_RPS = 1000.0
TARGET_P99_MS = 20.0


def seed(home: Path, entries: int) -> list[str]:
    """Store ``entries`` recommendations (one trial each); returns the query paths to rotate."""
    os.environ["MPADVISE_HOME"] = str(home)
    sys.path.insert(0, str(ROOT))
    from advisor.cache._store import Store

    with Store() as store:
        for number in range(entries):
            store.put_recommendation(
                hardware_fp="benchhardware0001", workload_fp=f"{number:016x}", script=f"/work/train_{number}.py",
                policy={"schema": 1, "mode": "bf16-mixed"}, speedup_vs_fp32=1.8, goodput=1000.0 + number,
                versions={"torch": "2.13.0"}, summary={"trials": 4},
                trials=[{"number": 0, "mode": "fp32", "outcome": "ok", "verdict": "stable", "goodput": 500.0}],
            )
    return ["/recommendations", "/recommendations?script=train_1.py", f"/recommendations?workload={2:016x}"]


def start_daemon(home: Path) -> tuple[subprocess.Popen[bytes], str, int]:
    env = dict(os.environ, MPADVISE_HOME=str(home), MPADVISE_QUIET="1")
    proc = subprocess.Popen([sys.executable, "-m", "advisor.cli", "daemon", "run", "--port", "0",
                             "--allowed-root", str(home)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    address = home / "daemon.json"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
        if address.exists():
            try:
                info = json.loads(address.read_text())
            except ValueError:
                info = {}
            if info.get("pid") == proc.pid:
                return proc, info["host"], info["port"]
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the daemon did not start within 60 s")


def load(
    host: str, port: int, paths: list[str], requests: int, clients: int, max_seconds: float, *, token: str | None = None
) -> dict[str, Any]:
    """Send ``requests`` GETs from ``clients`` threads, with the daemon's token; bounded by ``max_seconds``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    counter = iter(range(requests))
    deadline = time.monotonic() + max_seconds

    def client() -> None:
        conn = http.client.HTTPConnection(host, port, timeout=10)
        mine: list[float] = []
        try:
            while time.monotonic() < deadline:
                with lock:
                    number = next(counter, None)
                if number is None:
                    break
                started = time.perf_counter()
                try:
                    conn.request("GET", paths[number % len(paths)], headers=headers)
                    response = conn.getresponse()
                    body = response.read()
                except (OSError, http.client.HTTPException) as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    conn.close()
                    conn = http.client.HTTPConnection(host, port, timeout=10)
                    continue
                mine.append(time.perf_counter() - started)
                if response.status != 200 or not body.startswith(b'{"count":'):
                    errors.append(f"HTTP {response.status}: {body[:200]!r}")
        finally:
            conn.close()
            with lock:
                latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000 if latencies else float("nan")

    return {
        "requests": len(latencies), "errors": len(errors), "first_errors": errors[:5], "clients": clients,
        "wall_s": round(wall, 3), "requests_per_s": round(len(latencies) / wall, 1) if wall else 0.0,
        "p50_ms": round(pct(0.50), 3), "p90_ms": round(pct(0.90), 3), "p99_ms": round(pct(0.99), 3),
        "max_ms": round(latencies[-1] * 1000, 3) if latencies else None,
        "mean_ms": round(statistics.fmean(latencies) * 1000, 3) if latencies else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--entries", type=int, default=20, help="recommendations in the cache")
    parser.add_argument("--warmup", type=int, default=200, help="requests sent before measuring")
    parser.add_argument("--max-seconds", type=float, default=60.0)
    parser.add_argument("--json", type=Path, help="write the numbers here")
    args = parser.parse_args()

    home = Path(tempfile.mkdtemp(prefix="mpadvise-bench-daemon-"))
    paths = seed(home, args.entries)
    proc, host, port = start_daemon(home)
    try:
        token = (home / "daemon.token").read_text().strip()  # every read but /health needs it
        load(host, port, paths, args.warmup, args.clients, args.max_seconds, token=token)
        result = load(host, port, paths, args.requests, args.clients, args.max_seconds, token=token)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        shutil.rmtree(home, ignore_errors=True)
    import fastapi
    import uvicorn

    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"
    result.update(machine=machine, entries=args.entries, fastapi=fastapi.__version__, uvicorn=uvicorn.__version__,
                  target={"requests_per_s": TARGET_RPS, "p99_ms": TARGET_P99_MS},
                  meets_target=result["requests_per_s"] >= TARGET_RPS and result["p99_ms"] < TARGET_P99_MS)
    print(f"GET /recommendations on loopback: {machine}; fastapi {fastapi.__version__}, uvicorn {uvicorn.__version__}")
    print(f"{'requests':>9} {'clients':>7} {'errors':>6} {'req/s':>8} {'p50 ms':>7} {'p90 ms':>7} {'p99 ms':>7} {'max ms':>7}")
    print(f"{result['requests']:>9} {result['clients']:>7} {result['errors']:>6} {result['requests_per_s']:>8.0f} "
          f"{result['p50_ms']:>7.2f} {result['p90_ms']:>7.2f} {result['p99_ms']:>7.2f} {result['max_ms'] or 0:>7.2f}")
    print(f"target: >= {TARGET_RPS:.0f} req/s and p99 < {TARGET_P99_MS:.0f} ms: "
          + ("met" if result["meets_target"] else "NOT met"))
    if result["first_errors"]:
        print("first errors:", *result["first_errors"], sep="\n  ")
    if args.json:
        write_file_atomic(args.json, json.dumps(result, indent=2) + "\n")
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
