"""What a whole tune of a GPT-sized script costs: its trials and its trial-equivalents.

Runs ``mpadvise tune examples/gpt_lm.py --json --fresh`` (a CPU size by default) ``--repeats``
times, each in a fresh cache directory, and prints each run's winner, trials (the fp32 reference and its replicate included), re-measure rounds,
wall time and ``cost.trial_equivalents`` (the tune's wall time over one measured window of the
fp32 reference: start-up, warm-up and every rerun count as overhead), then their medians.

    .venv/bin/python scripts/bench_tune_cost.py [--repeats 3] [-- gpt_lm.py options]
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

ROOT = Path(__file__).resolve().parents[1]
CPU_SIZE = ["--width", "128", "--layers", "4", "--heads", "4", "--context", "64", "--vocab", "512"]


def tune(home: Path, script_args: list[str]) -> dict:
    env = {**os.environ, "MPADVISE_HOME": str(home), "COLUMNS": "200"}
    command = [sys.executable, "-m", "advisor.cli", "tune", str(ROOT / "examples" / "gpt_lm.py"), "--json", "--fresh",
               "--out", str(home / "gpt_lm.mpadvise.toml"), "--", *script_args]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode not in (0, 3):
        sys.exit(f"error: the tune exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}")
    data = json.loads(proc.stdout)
    cost = data.get("cost") or {}
    return {"winner": (data.get("winner") or {}).get("mode"), "trials": cost.get("trials"),
            "remeasure_rounds": data.get("remeasure_rounds"), "wall_s": round(wall, 1),
            "trial_equivalents": cost.get("trial_equivalents"), "window_s": cost.get("window_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("script_args", nargs="*", help="gpt_lm.py's options (default: a CPU size)")
    options = parser.parse_args()
    script_args = options.script_args or CPU_SIZE
    print(f"load average before: {os.getloadavg()[0]:.2f}; gpt_lm.py {' '.join(script_args)}", flush=True)
    runs = []
    for r in range(options.repeats):
        with tempfile.TemporaryDirectory(prefix="mpadvise-bench-cost-") as home:
            runs.append(tune(Path(home), script_args))
        print(f"tune {r}: " + ", ".join(f"{k} {v}" for k, v in runs[-1].items()), flush=True)
    medians = {k: statistics.median(r[k] for r in runs if r[k] is not None)
               for k in ("trials", "remeasure_rounds", "wall_s", "trial_equivalents")}
    print("median: " + ", ".join(f"{k} {v}" for k, v in medians.items())
          + f"; winners {sorted({r['winner'] for r in runs}, key=str)}; load average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
