"""One mode's speed-up over fp32 from ``mpadvise trial``, with trials started cold and warm,
alternating: does the launcher move the figure, or its scatter?

Each round runs ``mpadvise trial SCRIPT -m MODE --json`` twice, once with every trial started
cold (``MPADVISE_WARM_TRIALS=0``: a fresh interpreter) and once warm (forked from a server that
imported torch once), in alternating order, each in its own fresh ``MPADVISE_HOME``. Prints
each round's speed-ups and each launcher's median and range; writes JSON (``--json``).

    .venv/bin/python scripts/bench_cold_warm.py examples/mlp.py --mode bf16-true --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_agreement import cli, machine  # noqa: E402  (scripts/, this script's folder)

from advisor.trial import WARM_ENV  # noqa: E402
from probes import write_file_atomic  # noqa: E402


def speedup(script: Path, mode: str, warm: bool, extra: list[str]) -> float:
    """The mode's ``speedup_vs_fp32`` from one ``mpadvise trial``."""
    with tempfile.TemporaryDirectory() as home:
        env = {**os.environ, "MPADVISE_HOME": home, WARM_ENV: "1" if warm else "0"}
        env.pop("MPADVISE_POLICY", None)
        data = cli("trial", str(script), "-m", mode, "--json", *extra, timeout=1800, env=env)
    return float(data["candidates"][0]["speedup_vs_fp32"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", type=Path)
    parser.add_argument("--mode", default="bf16-mixed")
    parser.add_argument("--rounds", type=int, default=4, help="cold/warm pairs")
    parser.add_argument("--trial-args", default="", help="more trial options, e.g. --trial-args='--steps 200'")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    if not args.script.is_file():
        raise SystemExit(f"no such script: {args.script}")
    extra = args.trial_args.split()
    report: dict = {"script": str(args.script), "mode": args.mode, "trial_args": extra,
                    "machine": machine(),
                    "cold": [], "warm": []}
    for r in range(args.rounds):
        for warm in ((False, True) if r % 2 == 0 else (True, False)):
            figure = speedup(args.script.resolve(), args.mode, warm, extra)
            report["warm" if warm else "cold"].append(figure)
            print(f"round {r + 1} {'warm' if warm else 'cold'}: {args.mode} {figure:.3f}x fp32", flush=True)
    report["machine"]["load_average_after"] = os.getloadavg()
    for arm in ("cold", "warm"):
        figures = report[arm]
        report[f"{arm}_median"] = statistics.median(figures)
        print(f"{arm}: median {statistics.median(figures):.3f}x, range {min(figures):.3f}x to {max(figures):.3f}x "
              f"({', '.join(f'{f:.3f}' for f in figures)})")
    if args.json:
        write_file_atomic(args.json, json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
