"""What a CPU-bound neighbour does to a trial, with torch on all cores against on the cores left.

Runs ``mpadvise trial SCRIPT -m MODE --json`` four ways, interleaved over ``--repeats`` rounds:
no neighbour or ``--burners`` CPU-bound processes beside it, and torch on its own thread count or
on ``--threads`` (``OMP_NUM_THREADS``, which the trial's processes read when torch starts). For
each, prints the median over rounds of fp32's and the mode's median step, the step spread (the
90th percentile over the 10th, after the warm-up: the figure the disturbance check reads), the
speed-up and the trial's wall time; writes them with ``--json``.

    .venv/bin/python scripts/bench_busy_cpu.py examples/mlp.py --json docs/bench/busy-cpu-mlp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from advisor.tune._timing import step_spread
from probes import write_file_atomic

ROOT = Path(__file__).resolve().parents[1]


def trial(script: str, mode: str, steps: int, threads: int | None, burners: int) -> dict:
    """One ``mpadvise trial`` with ``burners`` neighbours for its whole length."""
    with tempfile.TemporaryDirectory(prefix="mpadvise-busy-") as home:
        env = {**os.environ, "MPADVISE_HOME": home}
        env.pop("MPADVISE_POLICY", None)
        env.pop("OMP_NUM_THREADS", None)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
        start = time.monotonic()
        try:
            proc = subprocess.run([sys.executable, "-m", "advisor.cli", "trial", script, "-m", mode, "--steps", str(steps),
                                   "--json", "--quiet"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        finally:
            for neighbour in neighbours:
                neighbour.kill()
                neighbour.wait()
        wall = time.monotonic() - start
    if proc.returncode not in (0, 3):
        raise SystemExit(f"the trial failed ({proc.returncode}): {proc.stderr.strip()[-500:]}")
    data = json.loads(proc.stdout)
    runs = {"fp32": data["reference"], mode: data["candidates"][0]}
    out: dict = {"wall_s": round(wall, 2), "speedup": runs[mode]["speedup_vs_fp32"]}
    warmup = data["settings"]["warmup_steps"]
    for name, run in runs.items():
        times = run["step_times"]
        out[name] = {"median_ms": statistics.median(times[warmup:]) * 1e3, "spread": step_spread(times, warmup)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("script", nargs="?", default="examples/mlp.py")
    parser.add_argument("--mode", default="bf16-mixed")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--burners", type=int, default=1, help="CPU-bound neighbours in the busy arms")
    parser.add_argument("--threads", type=int, default=1, help="torch's threads in the 'cores left' arms")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the four arms, interleaved")
    parser.add_argument("--json", type=Path, dest="json_out")
    args = parser.parse_args()
    arms = [("quiet, torch's threads", None, 0), (f"quiet, {args.threads} thread(s)", args.threads, 0),
            (f"{args.burners} neighbour(s), torch's threads", None, args.burners),
            (f"{args.burners} neighbour(s), {args.threads} thread(s)", args.threads, args.burners)]
    runs: dict[str, list[dict]] = {name: [] for name, _, _ in arms}
    for round_ in range(args.repeats):
        for name, threads, burners in arms if round_ % 2 == 0 else reversed(arms):
            runs[name].append(trial(args.script, args.mode, args.steps, threads, burners))
            print(f"round {round_ + 1}: {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    med = statistics.median
    rows = {}
    print(f"{'arm':34s} {'fp32 ms':>9s} {'spread':>7s} {args.mode + ' ms':>15s} {'spread':>7s} {'speed-up':>8s} {'wall s':>7s}")
    for name, _, _ in arms:
        r = runs[name]
        row = {"fp32_ms": med(x["fp32"]["median_ms"] for x in r), "fp32_spread": med(x["fp32"]["spread"] for x in r),
               "mode_ms": med(x[args.mode]["median_ms"] for x in r), "mode_spread": med(x[args.mode]["spread"] for x in r),
               "speedup": med(x["speedup"] for x in r), "wall_s": med(x["wall_s"] for x in r)}
        rows[name] = row
        print(f"{name:34s} {row['fp32_ms']:9.2f} {row['fp32_spread']:7.2f} {row['mode_ms']:15.2f} "
              f"{row['mode_spread']:7.2f} {row['speedup']:8.3f} {row['wall_s']:7.1f}")
    if args.json_out:
        write_file_atomic(args.json_out, json.dumps({
            "script": args.script, "mode": args.mode, "steps": args.steps, "burners": args.burners,
            "threads": args.threads, "repeats": args.repeats, "medians": rows, "runs": runs,
            "cpus": len(os.sched_getaffinity(0)), "load_before": os.getloadavg()}, indent=1) + "\n")


if __name__ == "__main__":
    main()
