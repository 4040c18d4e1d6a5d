"""What a CPU-bound neighbour does to a trial, with torch on all cores against on the cores left.

Runs fp32 and ``--mode`` on SCRIPT through the trial runner of ``mpadvise trial`` and ``tune``
itself, without the watch that picks the threads (so the first arm below is what trials were
before it), four ways, interleaved over ``--repeats`` rounds: no neighbour or ``--burners``
CPU-bound processes beside both trials, and torch on its own thread count or on ``--threads``
(``ScriptRunner.with_threads``, as the watch sets it). For each, prints the median over rounds of
fp32's and the mode's median step, the step spread (the 90th percentile over the 10th, after the
warm-up: the figure the disturbance check reads), the speed-up and the wall time of the two
trials; writes them with ``--json``.

    .venv/bin/python scripts/bench_busy_cpu.py examples/mlp.py --json docs/bench/busy-cpu-mlp-amx.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from advisor.frameworks import plan_for
from advisor.tune._options import TuneOptions
from advisor.tune._timing import step_spread
from advisor.tune._trials import ScriptRunner, TrialSettings, evaluate, prestarted_launcher
from policies import Policy
from probes import write_file_atomic


def trial(runner: ScriptRunner, mode: str, threads: int | None, burners: int) -> dict:
    """fp32, then ``mode``, on ``threads`` threads, with ``burners`` neighbours for both."""
    runner = runner.with_threads(threads)
    neighbours = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(burners)]
    start = time.monotonic()
    try:
        fp32, other = (runner(Policy(mode=m), m) for m in ("fp32", mode))
    finally:
        for neighbour in neighbours:
            neighbour.kill()
            neighbour.wait()
    wall = time.monotonic() - start
    for result in (fp32, other):
        if result.outcome != "ok":
            raise SystemExit(f"{result.label} failed: {result.outcome}: {result.reason}")
    ev = evaluate(mode, Policy(mode=mode), other, fp32)
    out: dict = {"wall_s": round(wall, 2), "speedup": ev.speedup}
    for name, result in (("fp32", fp32), (mode, other)):
        warmup = result.warmup_steps
        out[name] = {"median_ms": statistics.median(result.step_times[warmup:]) * 1e3,
                     "spread": step_spread(result.step_times, warmup)}
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
    script = Path(args.script)
    plan = plan_for(script, None, device=None)
    options = TuneOptions(steps=args.steps)
    runner = ScriptRunner(script, [], TrialSettings.for_tune(options.with_(framework=plan.framework)),
                          launch=plan.launch, warm=prestarted_launcher(script, [], plan.launch))
    try:
        for round_ in range(args.repeats):
            for name, threads, burners in arms if round_ % 2 == 0 else reversed(arms):
                runs[name].append(trial(runner, args.mode, threads, burners))
                print(f"round {round_ + 1}: {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    finally:
        runner.close()
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
