"""How many PostgreSQL connections the workers of one shared study hold.

Starts a throwaway PostgreSQL server (the test suite's own, ``tests/integration/_postgres.py``:
``initdb`` in a temporary directory, loopback only, as the ``postgres`` user under root), runs
``--workers`` real ``mpadvise tune --storage postgresql://...`` processes of ``examples/mlp.py``
on one study, each with its own cache, and samples ``pg_stat_activity`` every 0.2 s while they
run. Prints, per worker and in all, the most connections seen at once, and writes them as JSON
with ``--out``. This sizes ``max_connections`` (and the case for pgbouncer) for a fleet:
``docs/distributed.md``, "Many nodes: the database".

    python scripts/bench_pg_connections.py --workers 2 --out docs/bench/pg-connections.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

from _postgres import SERVER_USER, start_server, stop_server, why_not_here  # noqa: E402

TUNE = ["--steps", "32", "--warmup", "2", "--no-priors", "-m", "bf16-mixed", "--json"]


def _connections(dsn: str, database: str) -> dict[int, int]:
    """Client backends connected to ``database``, counted by the client's process id as
    PostgreSQL sees its port (mapped to workers by the caller)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT client_port FROM pg_stat_activity WHERE datname = %s AND backend_type = 'client backend' "
            "AND pid <> pg_backend_pid()", (database,)).fetchall()
    return {port: 1 for (port,) in rows if port is not None}


def _ports_of(pids: set[int]) -> dict[int, int]:
    """Local TCP ports of sockets held by ``pids`` (and their children): port -> owning pid."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    ports: dict[int, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[9] in inodes:
                ports[int(fields[1].rsplit(":", 1)[1], 16)] = inodes[fields[9]]
    return ports


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    reason = why_not_here()
    if reason is not None:
        print(f"bench_pg_connections: {reason}", file=sys.stderr)
        return 1
    server = start_server()
    try:
        database = "bench_connections"
        url = server.create_database(database)
        dsn = f"host={server.socket_dir} port={server.port} user={SERVER_USER} dbname=postgres"
        with tempfile.TemporaryDirectory() as tmp:
            procs = []
            for i in range(args.workers):
                home = Path(tmp) / f"node-{i}"
                home.mkdir()
                env = {**os.environ, "MPADVISE_HOME": str(home / "home"), "MPADVISE_HEARTBEAT_S": "1",
                       "MPADVISE_GRACE_S": "3"}
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "advisor.cli", "tune", str(ROOT / "examples" / "mlp.py"), "--storage", url,
                     "--out", str(home / "mlp.mpadvise.toml"), *TUNE],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=ROOT))
            peak_each = [0] * len(procs)
            peak_all = 0
            while any(p.poll() is None for p in procs):
                held = _connections(dsn, database)
                owners = _ports_of({p.pid for p in procs})
                counts = [0] * len(procs)
                for port in held:
                    pid = owners.get(port)
                    for i, p in enumerate(procs):
                        if pid == p.pid:
                            counts[i] += 1
                peak_each = [max(a, b) for a, b in zip(peak_each, counts)]
                peak_all = max(peak_all, len(held))
                time.sleep(0.2)
            codes = [p.returncode for p in procs]
    finally:
        stop_server(server)
    result = {"workers": args.workers, "exit_codes": codes, "most_connections_per_worker": peak_each,
              "most_connections_in_all": peak_all, "machine": f"{platform.machine()} {os.cpu_count()} CPUs",
              "python": platform.python_version()}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(c in (0, 3) for c in codes) else 1


if __name__ == "__main__":
    raise SystemExit(main())
