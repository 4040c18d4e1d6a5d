"""A cache writer process for the concurrency and crash tests (run with ``python``, not pytest).

Usage::

    python _cache_writer.py burst DB BARRIER_DIR WORKER SHARED_KEYS OWN_KEYS TRIALS
    python _cache_writer.py loop DB READY_FILE TRIALS
    python _cache_writer.py check DB

``burst`` writes ``BARRIER_DIR/ready-WORKER``, waits for ``BARRIER_DIR/go`` so that every
worker opens the (possibly not yet created) database and writes at the same moment, then
stores SHARED_KEYS recommendations under keys every worker uses and OWN_KEYS under keys of
its own, reading each one back. ``loop`` stores recommendations with TRIALS trials each until
it is killed, touching READY_FILE after its first commit. ``check`` opens the database through
the store, reads every recommendation back with its trials, and prints how many there are.

Every recommendation records its trial count in ``summary["trial_count"]``, so a test can
check that no reader ever sees, and no crash ever leaves, a recommendation with a partial
set of trials. Exit status 0 means every write and read-back succeeded; anything the store
raises goes to stderr, which the tests require to be empty.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
# Load the store without running advisor/__init__.py, which imports torch: sixteen processes
# each importing torch on a 2-core machine would measure torch, not the store.
_package = types.ModuleType("advisor")
_package.__path__ = [str(REPO / "advisor")]
sys.modules.setdefault("advisor", _package)

from advisor.cache._store import Store  # noqa: E402

HARDWARE_FP = "0123456789abcdef"


def _workload_fp(key: str) -> str:
    # Any stable 16-hex value per key name will do; the store only checks the shape.
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _put(store: Store, key: str, writer: str, trial_count: int) -> None:
    store.put_recommendation(
        hardware_fp=HARDWARE_FP,
        workload_fp=_workload_fp(key),
        script=f"{key}.py",
        policy={"mode": "bf16-mixed", "micro_batch_size": 32},
        speedup_vs_fp32=1.5,
        goodput=1000.0,
        versions={"torch": "test"},
        summary={"trial_count": trial_count, "writer": writer, "key": key},
        trials=[
            {
                "number": number,
                "mode": "bf16-mixed",
                "params": {"micro_batch_size": 32},
                "outcome": "ok",
                "verdict": "stable",
                "goodput": 1000.0 + number,
                "metrics": {"losses": [1.0, 0.9, 0.8], "writer": writer},
            }
            for number in range(trial_count)
        ],
    )


def _check(store: Store, key: str) -> None:
    rows = store.find_recommendations(hardware_fp=HARDWARE_FP, workload_fp=_workload_fp(key), with_trials=True)
    record = rows[0] if rows else None
    if record is None:
        raise SystemExit(f"read-back of {key} found nothing")
    if len(record["trials"]) != record["summary"]["trial_count"]:
        raise SystemExit(
            f"read-back of {key} saw {len(record['trials'])} trials, "
            f"expected {record['summary']['trial_count']}"
        )


def burst(db: str, barrier: str, worker: str, shared: int, own: int, trials: int) -> None:
    barrier_dir = Path(barrier)
    (barrier_dir / f"ready-{worker}").touch()
    go = barrier_dir / "go"
    deadline = time.monotonic() + 60
    while not go.exists():
        if time.monotonic() > deadline:
            raise SystemExit("barrier never opened")
        time.sleep(0.002)
    store = Store(Path(db))
    keys = [f"shared-{index}" for index in range(shared)]
    keys += [f"worker-{worker}-{index}" for index in range(own)]
    # Interleave shared and own keys so that replacements and inserts contend together.
    keys.sort(key=lambda name: (name.rsplit("-", 1)[1], name))
    for key in keys:
        _put(store, key, worker, trials)
        _check(store, key)
    store.close()


def loop(db: str, ready_file: str, trials: int) -> None:
    store = Store(Path(db))
    count = 0
    while True:
        # A few keys replaced over and over, and new keys, so a kill can land in either path.
        key = f"replaced-{count % 3}" if count % 2 else f"new-{count}"
        _put(store, key, str(os.getpid()), trials + count % 7)
        if count == 0:
            Path(ready_file).touch()
        count += 1


def check(db: str) -> None:
    store = Store(Path(db))
    records = store.list_recommendations(with_trials=True)
    for record in records:
        if len(record["trials"]) != record["summary"]["trial_count"]:
            raise SystemExit(f"recommendation {record['id']} has a partial set of trials")
    store.close()
    print(len(records))


def main(argv: list[str]) -> None:
    command = argv[0]
    if command == "burst":
        db, barrier, worker, shared, own, trials = argv[1:]
        burst(db, barrier, worker, int(shared), int(own), int(trials))
    elif command == "loop":
        db, ready_file, trials = argv[1:]
        loop(db, ready_file, int(trials))
    elif command == "check":
        check(argv[1])
    else:
        raise SystemExit(f"unknown command {command!r}; expected burst, loop or check")


if __name__ == "__main__":
    main(sys.argv[1:])
