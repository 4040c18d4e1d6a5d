"""What resolving the policy from the cache adds to ``advisor.load_policy()``.

In one run, with torch already imported: ``MPADVISE_HOME`` points at a temporary directory
holding one recommendation for this machine and this script (plus ``--filler`` entries for
other scripts), and two calls are interleaved, alternating which goes first each round:

* ``cache``: ``advisor.load_policy()``, which finds the entry (checked: its source must be the
  cache entry);
* ``hand``: ``advisor.load_policy(advisor.Policy(mode=...))``, the same mode built by hand.

Both probe the hardware and build the same AppliedPolicy, so the difference of their medians
is what the cache lookup adds. Also printed: ``lookup()`` alone, and the first call of each
(in a fresh process that includes importing the cache module and sqlite-utils, once).

    .venv/bin/python scripts/bench_lookup.py [--repeats 200] [--filler 0] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Before advisor configures its logger: one "policy ... (from ...)" line per call would
# otherwise dominate what is measured.
os.environ["MPADVISE_QUIET"] = "1"
# The seeding child inherits the parent's directory.
HOME = os.environ.get("MPADVISE_BENCH_HOME") or tempfile.mkdtemp(prefix="mpadvise-bench-lookup-")
os.environ["MPADVISE_BENCH_HOME"] = HOME
os.environ["MPADVISE_HOME"] = HOME
os.environ.pop("MPADVISE_POLICY", None)

import torch  # noqa: E402  (imported first on purpose: the target is "with torch imported")

import advisor  # noqa: E402
import probes  # noqa: E402
from policies import Policy, safe_default_mode  # noqa: E402
from probes import write_file_atomic  # noqa: E402

SCRIPT = Path(__file__).resolve()


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def seed_cache(profile: probes.HardwareProfile, mode: str, filler: int) -> None:
    from advisor.cache._recommend import record_tune

    trials = [{"number": 0, "mode": "fp32", "outcome": "ok", "verdict": "stable", "goodput": 100.0}]
    for index in range(filler):
        record_tune(
            profile=profile, policy=Policy(mode=mode), script=SCRIPT.with_name(f"other_{index}.py"),
            workload_fingerprint=f"{index + 1:016x}", trials=trials, speedup_vs_fp32=1.0, goodput=100.0,
        )
    recommendation_id = record_tune(
        profile=profile, policy=Policy(mode=mode), script=SCRIPT, workload_fingerprint="f" * 16,
        trials=trials, speedup_vs_fp32=1.0, goodput=100.0,
    )
    if recommendation_id is None:
        sys.exit(f"could not write the cache in {HOME}")


def quartiles(values: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="interleaved rounds")
    parser.add_argument("--warmup", type=int, default=10, help="untimed rounds first")
    parser.add_argument("--filler", type=int, default=0, help="extra entries for other scripts")
    parser.add_argument("--json", dest="json_path", help="write the results here")
    parser.add_argument("--seed-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    profile = probes.primary_profile()
    mode = safe_default_mode(profile)[0]
    by_hand = Policy(mode=mode)
    if args.seed_only:
        seed_cache(profile, mode, args.filler)
        return
    # Seeded by a child process, so that this one has not imported the cache module yet and
    # its first load_policy() shows what a training run pays once.
    subprocess.run([sys.executable, __file__, "--seed-only", "--filler", str(args.filler)], check=True)

    # First calls: hand first, so that what both paths import is charged to it, and the cache
    # path's first call shows the one-time cost of its own imports and first open.
    first_hand = timed(lambda: advisor.load_policy(by_hand))
    first_cache = timed(lambda: advisor.load_policy())
    applied = advisor.load_policy()
    if not applied.source.startswith("cache entry"):
        sys.exit(f"load_policy() did not resolve from the cache: {applied.source}")

    from advisor.cache._recommend import lookup

    calls = {
        "hand": lambda: advisor.load_policy(by_hand),
        "cache": lambda: advisor.load_policy(),
        "lookup": lambda: lookup(profile, SCRIPT),
    }
    for _ in range(args.warmup):
        for call in calls.values():
            call()
    samples: dict[str, list[float]] = {name: [] for name in calls}
    added: list[float] = []
    for round_index in range(args.repeats):
        order = list(calls) if round_index % 2 == 0 else list(reversed(calls))
        this_round = {name: timed(calls[name]) for name in order}
        for name, seconds in this_round.items():
            samples[name].append(seconds)
        added.append(this_round["cache"] - this_round["hand"])

    rows = []
    for name, values in samples.items():
        low, high = quartiles(values)
        rows.append({"call": name, "median_ms": statistics.median(values) * 1e3,
                     "q1_ms": low * 1e3, "q3_ms": high * 1e3})
    added_median = (statistics.median(samples["cache"]) - statistics.median(samples["hand"])) * 1e3
    added_low, added_high = quartiles(added)
    machine = (f"{profile.name} ({profile.kind}), {os.cpu_count()} CPUs, {platform.python_implementation()} "
               f"{platform.python_version()}, torch {torch.__version__}")
    result = {
        "machine": machine,
        "mode": mode,
        "cache_entries": args.filler + 1,
        "repeats": args.repeats,
        "rows": rows,
        "added_ms": added_median,
        "added_per_round_median_ms": statistics.median(added) * 1e3,
        "added_per_round_iqr_ms": [added_low * 1e3, added_high * 1e3],
        "first_call_ms": {"hand": first_hand * 1e3, "cache": first_cache * 1e3},
        "target_ms": 10.0,
    }

    print(f"machine: {machine}")
    print(f"mode {mode}; {args.filler + 1} cache entries; {args.repeats} interleaved rounds")
    print(f"{'call':<40} {'median ms':>10} {'IQR ms':>16}")
    labels = {"hand": f"load_policy(Policy(mode={mode!r}))", "cache": "load_policy()  [from the cache]",
              "lookup": "lookup() alone"}
    for row in rows:
        print(f"{labels[row['call']]:<40} {row['median_ms']:>10.3f} {row['q1_ms']:>7.3f}-{row['q3_ms']:.3f}")
    print(f"added by the cache: {added_median:.3f} ms (per-round difference: median "
          f"{result['added_per_round_median_ms']:.3f}, IQR {added_low * 1e3:.3f}-{added_high * 1e3:.3f}); target < 10 ms")
    print(f"first call in this process: hand {first_hand * 1e3:.1f} ms, cache {first_cache * 1e3:.1f} ms "
          "(the cache's includes importing its modules once)")
    if args.json_path:
        write_file_atomic(args.json_path, json.dumps(result, indent=2))


if __name__ == "__main__":
    try:
        main()
    finally:
        if "--seed-only" not in sys.argv:
            shutil.rmtree(HOME, ignore_errors=True)
