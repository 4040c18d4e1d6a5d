"""Score mpadvise's stability verdicts against the verdict zoo's known truths.

Runs each case of tests/verdicts as mpadvise's own short trial (``mpadvise trial CASE -m
MODE... --json``, the default window of 5 warm-up and 40 measured steps unless the manifest
gives the case a longer one), reads each candidate's verdict (``outcome``: ok and stable, or
unstable; anything else, a crash or a timeout, is an error), compares it with the truth that
scripts/verdict_truth.py recorded from long runs (tests/verdicts/truth.json), and prints one
table per mode: cases judged, false-stable and false-unstable verdicts, with the cases named.
The "window" column applies the truth rule to the trial's own short curves: where it disagrees
with the long-run truth, the trial window itself did not show what the long run shows.

Exits 1 if any verdict is false (or a trial failed to run).

    nice .venv/bin/python scripts/bench_verdicts.py [--cheap] [--case NAME ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "verdicts"))

import zoo  # noqa: E402

from probes import write_file_atomic  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cheap", action="store_true", help="only the cheap half (what CI runs)")
    parser.add_argument("--case", nargs="*", default=[], help="only these cases")
    parser.add_argument("--steps", type=int, help="measured steps of every trial, overriding the manifest")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per case")
    parser.add_argument("--json", type=Path, dest="json_out", help="write the results here")
    args = parser.parse_args()

    cases = zoo.select(zoo.load_cases(), cheap=args.cheap, names=args.case)
    truth = zoo.load_truth()
    began = time.monotonic()
    scored: list[zoo.Scored] = []
    runs = []
    for case in cases:
        results, run = zoo.score_case(case, truth, steps=args.steps, timeout=args.timeout)
        scored += results
        runs.append({"case": case.name, "command": zoo.shown(run.command), "wall_s": round(run.wall_s, 1),
                     "returncode": run.returncode})
        print(f"{case.name} ({run.wall_s:.0f} s): {zoo.shown(run.command)}", flush=True)
        for s in results:
            mark = "ok" if s.verdict == s.truth else ("FALSE-STABLE" if s.false_stable else
                                                     "FALSE-UNSTABLE" if s.false_unstable else "ERROR")
            window = "" if s.window_truth == s.truth else f" [window shows {s.window_truth}]"
            print(f"  {s.mode:12s} truth {s.truth:9s} verdict {s.verdict:9s} {mark}{window}", flush=True)
            if s.verdict != s.truth:
                print(f"      {s.reason}", flush=True)
    elapsed = time.monotonic() - began
    summary = zoo.summarise(scored)

    print()
    print(f"{'mode':12s} {'cases':>5s} {'false-stable':>12s} {'false-unstable':>14s} {'errors':>6s}  offending cases")
    for mode, row in summary.items():
        named = [f"{c} (false-stable)" for c in row["false_stable"]]
        named += [f"{c} (false-unstable)" for c in row["false_unstable"]]
        named += [f"{c} (error)" for c in row["errors"]]
        print(f"{mode:12s} {row['cases']:5d} {len(row['false_stable']):12d} {len(row['false_unstable']):14d} "
              f"{len(row['errors']):6d}  {', '.join(named)}")
    false_stable = sum(len(r["false_stable"]) for r in summary.values())
    false_unstable = sum(len(r["false_unstable"]) for r in summary.values())
    errors = sum(len(r["errors"]) for r in summary.values())
    print(f"{'all':12s} {len(scored):5d} {false_stable:12d} {false_unstable:14d} {errors:6d}")
    print(f"{len(cases)} cases, {len(scored)} verdicts in {elapsed:.0f} s")

    if args.json_out:
        write_file_atomic(args.json_out, json.dumps({
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "cheap": args.cheap,
            "elapsed_s": round(elapsed, 1),
            "false_stable": false_stable,
            "false_unstable": false_unstable,
            "errors": errors,
            "summary": summary,
            "verdicts": [s.to_dict() for s in scored],
            "runs": runs,
        }, indent=1) + "\n")
    return 1 if false_stable or false_unstable or errors else 0


if __name__ == "__main__":
    sys.exit(main())
