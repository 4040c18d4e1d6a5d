"""A tune with CPU-bound neighbours started during its fp32 reference, against the same tune undisturbed.

Runs ``mpadvise tune SCRIPT --json`` twice on a copy of the script, each in a fresh home: once
on its own, then with ``--burners`` CPU-bound processes (``0``: a control, undisturbed again)
started the moment the tune's first trial (the fp32 reference) is launched and kept until the
tune ends, or for ``--burst-s`` seconds only (a burst that passes). ``--duty D`` makes each
neighbour busy for only the first D of every second (0.15: a process that wakes briefly, the
kind a tune should outlive, not make way for). Prints each tune's winner,
its speed-up with the 95% interval, every disturbed run the tune saw and ran again, and whether
the second speed-up lies inside the first interval and the two intervals overlap; writes both
tunes' JSON (``--out``).

With ``--rounds N`` it runs N such pairs, the order within a pair alternating (undisturbed
first, then disturbed first, ...), and then asks of every disturbed tune whether its speed-up
lies inside each undisturbed tune's interval, and of every undisturbed tune the same about the
other undisturbed ones (the control): on a host whose own ratio moves from minute to minute,
the disturbance is harmless when the first rate is not below the second.

    .venv/bin/python scripts/bench_disturbed.py examples/mlp.py --tune-args="--trials 12 --steps 200"
    .venv/bin/python scripts/bench_disturbed.py examples/mlp.py --burners 1 --burst-s 20 \
        --tune-args="--trials 12 --steps 200"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from probes import write_file_atomic

ROOT = Path(__file__).resolve().parents[1]


def neighbour_code(duty: float) -> str:
    """A neighbour's program: CPU-bound, or busy for the first ``duty`` of every second."""
    if duty >= 1.0:
        return "while True: pass"
    return ("import time\nwhile True:\n    start = time.monotonic()\n"
            f"    while time.monotonic() - start < {duty!r}: pass\n    time.sleep({1.0 - duty!r})")


def tune(script: Path, tune_args: list[str], burners: int, work: Path, burst_s: float | None = None,
         duty: float = 1.0) -> dict:
    """One tune of ``script`` (copied into ``work``); ``burners`` neighbours (busy ``duty`` of
    every second) from its first trial on, until it ends or for ``burst_s`` seconds."""
    home, tmp = work / "home", work / "tmp"
    home.mkdir()
    tmp.mkdir()
    copy = work / script.name
    shutil.copy(script, copy)
    env = {**os.environ, "MPADVISE_HOME": str(home), "TMPDIR": str(tmp)}
    env.pop("MPADVISE_POLICY", None)
    proc = subprocess.Popen([sys.executable, "-m", "advisor.cli", "tune", str(copy), *tune_args, "--json"],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    neighbours: list[subprocess.Popen[bytes]] = []
    started = stopped = None
    try:
        if burners:
            # The tune's trial directory holds each trial's spec from its launch on.
            while proc.poll() is None and not list(tmp.glob("mpadvise-trial-*/trial-1.spec.json")):
                time.sleep(0.02)
            if proc.poll() is None:
                neighbours = [subprocess.Popen([sys.executable, "-c", neighbour_code(duty)]) for _ in range(burners)]
                started = time.monotonic()
        if burst_s is not None and neighbours:
            try:
                out, err = proc.communicate(timeout=burst_s)
            except subprocess.TimeoutExpired:
                stopped = stop(neighbours)
                out, err = proc.communicate(timeout=3600)
        else:
            out, err = proc.communicate(timeout=3600)
    finally:
        stopped = stopped or stop(neighbours)
    if proc.returncode != 0:
        raise SystemExit(f"the tune failed ({proc.returncode}): {err.strip()[-500:]}")
    data = json.loads(out)
    data["neighbours_s"] = None if started is None else round((stopped or time.monotonic()) - started, 1)
    return data


def stop(neighbours: list[subprocess.Popen[bytes]]) -> float | None:
    """Kill the neighbours still running; when the first was killed (``None`` for none)."""
    when = None
    for neighbour in neighbours:
        if neighbour.poll() is None:
            neighbour.kill()
            when = when or time.monotonic()
        neighbour.wait()
    return when


def describe(name: str, data: dict) -> str:
    speedup = data.get("speedup") or {}
    lines = [f"{name}: winner {data['winner_label']}, {speedup.get('ratio')}x fp32 "
             f"[{speedup.get('low')}, {speedup.get('high')}] ({speedup.get('basis')})"]
    if data.get("neighbours_s") is not None:
        lines[0] += f"; neighbours ran for {data['neighbours_s']} s of it"
    lines += [f"  {event['text']}" for event in data.get("disturbed") or []]
    return "\n".join(lines)


def inside(point: dict, interval: dict) -> bool | None:
    """Whether ``point``'s paired speed-up lies inside ``interval``'s 95% interval (``None`` when
    either has no figure)."""
    ratio = (point.get("speedup") or {}).get("ratio")
    low, high = ((interval.get("speedup") or {}).get(k) for k in ("low", "high"))
    if ratio is None or low is None or high is None:
        return None
    return low <= ratio <= high


def cross_inside(points: list[dict], intervals: list[dict], *, same: bool = False) -> tuple[int, int]:
    """How many (point, interval) pairs have the point inside, out of those with figures; with
    ``same`` the two lists are one, and a tune is not compared with itself."""
    hits = total = 0
    for i, point in enumerate(points):
        for j, interval in enumerate(intervals):
            if same and i == j:
                continue
            found = inside(point, interval)
            if found is not None:
                hits, total = hits + found, total + 1
    return hits, total


def rounds_summary(rounds: list[dict]) -> dict:
    """Every disturbed tune against every undisturbed interval, and the undisturbed ones against
    each other (the control); the winners of each kind; how many of each kind measured their
    speed-up on fewer threads than torch's own."""
    quiet = [r["undisturbed"] for r in rounds]
    busy = [r["disturbed"] for r in rounds]
    return {"disturbed_inside_undisturbed": cross_inside(busy, quiet),
            "undisturbed_inside_undisturbed": cross_inside(quiet, quiet, same=True),
            "winners": {"undisturbed": [t.get("winner_label") for t in quiet],
                        "disturbed": [t.get("winner_label") for t in busy]},
            "on_fewer_threads": {"undisturbed": sum(fewer_threads(t) for t in quiet),
                                 "disturbed": sum(fewer_threads(t) for t in busy)}}


def fewer_threads(data: dict) -> bool:
    """Whether a tune's speed-up was measured on fewer threads than torch's own."""
    return (data.get("speedup") or {}).get("threads") is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", type=Path)
    parser.add_argument("--tune-args", default="", help="more tune options, e.g. --tune-args='--trials 12'")
    parser.add_argument("--burners", type=int, default=2, help="CPU-bound neighbours in the disturbed tune")
    parser.add_argument("--burst-s", type=float, help="stop the neighbours after this many seconds (default: "
                        "they run until the tune ends)")
    parser.add_argument("--duty", type=float, default=1.0,
                        help="the share of every second each neighbour is busy (default 1: CPU-bound)")
    parser.add_argument("--rounds", type=int, default=1, help="pairs of tunes, the order within a pair alternating")
    parser.add_argument("--out", type=Path, help="write both tunes' JSON here")
    args = parser.parse_args()
    script = args.script.resolve()
    if not script.is_file():
        raise SystemExit(f"no such script: {args.script}")
    if args.rounds < 1:
        raise SystemExit(f"--rounds must be at least 1, got {args.rounds}")
    if not 0.0 < args.duty <= 1.0:
        raise SystemExit(f"--duty must be above 0 and at most 1, got {args.duty}")
    tune_args = shlex.split(args.tune_args)
    rounds = []
    for r in range(args.rounds):
        results = {}
        # With no neighbours the disturbed tune is a control: how far two undisturbed tunes differ here.
        kinds = (("undisturbed", 0), ("disturbed", args.burners))
        for name, burners in kinds if r % 2 == 0 else kinds[::-1]:
            with tempfile.TemporaryDirectory(prefix="mpadvise-disturbed-") as work:
                results[name] = tune(script, tune_args, burners, Path(work), args.burst_s, args.duty)
            label = name if burners or name == "undisturbed" else "undisturbed again (control)"
            print(describe(label if args.rounds == 1 else f"round {r + 1}, {label}", results[name]), flush=True)
        quiet, busy = results["undisturbed"], results["disturbed"]
        # Two honest 95% intervals of one ratio overlap far more often than either holds the
        # other's point (about 83% of the time for equal widths, less when the second is wider).
        b_low, b_high = busy["speedup"]["low"], busy["speedup"]["high"]
        low, high = quiet["speedup"]["low"], quiet["speedup"]["high"]
        overlap = None not in (low, high, b_low, b_high) and b_low <= high and low <= b_high
        print(f"same winner: {quiet['winner_label'] == busy['winner_label']}; the disturbed speed-up inside the "
              f"undisturbed interval: {bool(inside(busy, quiet))}; the intervals overlap: {overlap}")
        rounds.append(results)
    record = {"script": str(args.script), "tune_args": tune_args, "burners": args.burners, "burst_s": args.burst_s,
              "duty": args.duty}
    if args.rounds == 1:
        record.update(rounds[0])
    else:
        summary = rounds_summary(rounds)
        hits, total = summary["disturbed_inside_undisturbed"]
        c_hits, c_total = summary["undisturbed_inside_undisturbed"]
        print(f"disturbed speed-ups inside an undisturbed interval: {hits} of {total}; undisturbed ones inside"
              f" another undisturbed interval (control): {c_hits} of {c_total}")
        print(f"winners: undisturbed {summary['winners']['undisturbed']}, disturbed {summary['winners']['disturbed']}")
        fewer = summary["on_fewer_threads"]
        print(f"speed-ups measured on fewer threads than torch's: undisturbed {fewer['undisturbed']} of {args.rounds}, "
              f"disturbed {fewer['disturbed']} of {args.rounds}")
        record.update({"rounds": rounds, "summary": summary})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(args.out, json.dumps(record, indent=2, default=str))


if __name__ == "__main__":
    main()
