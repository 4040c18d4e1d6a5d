"""Does a trial's place in the sequence move its speed? The `trial` figure against the tune's.

`mpadvise trial SCRIPT -m MODE` divides one run of MODE (the third trial) by one run of fp32
(the first, the process that also starts the warm server's first fork). A tune re-measures
MODE and fp32 in interleaved pairs later on, alternating which runs first. When the two
disagree on the same script, the order of the trials is one suspect: this runs both
protocols in one sequence, through the same runner (warm trials, the tune's window), so that
their figures and the place of each run can be compared directly:

    F0 F1 M0 | F M | M F | F M | ...     (one session: one warm server, as one command)

* ``trial``: M0 / F0, the `trial` command's figure;
* ``paired``: the paired figure over the rounds after it, as a tune's re-measurement gives;
* ``first fp32`` over the rounds' fp32 median: whether the first trial of a command runs
  slower (or faster) than later ones;
* ``slot``: each mode's goodput when it ran first in its pair over when it ran second.

``--sessions`` repeats the whole sequence, each with a new warm server. Prints a table and
writes JSON (``--json``). Goodput is the tune's (samples per second over the median step):

    .venv/bin/python scripts/bench_order.py tests/integration/scripts/accelerate_known_speedup.py
    .venv/bin/python scripts/bench_order.py tests/integration/scripts/known_speedup.py --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench_agreement import machine  # noqa: E402  (scripts/, this script's folder)

from advisor.frameworks import plan_for  # noqa: E402
from advisor.tune._options import TuneOptions  # noqa: E402
from advisor.tune._timing import paired_gap, step_spread  # noqa: E402
from advisor.tune._trials import ScriptRunner, TrialSettings, evaluate, prestarted_launcher  # noqa: E402
from policies import Policy  # noqa: E402
from probes import write_file_atomic  # noqa: E402


def session(script: Path, args: list[str], mode: str, rounds: int, options: TuneOptions) -> list[dict]:
    """One command's worth of trials: F0, F1, M0, then ``rounds`` pairs in alternating order."""
    plan = plan_for(script, None, device=None)
    warm = prestarted_launcher(script, args, plan.launch)
    runner = ScriptRunner(script, args, TrialSettings.for_tune(options.with_(framework=plan.framework)),
                          launch=plan.launch, warm=warm)
    order = [("fp32", "F0"), ("fp32", "F1"), (mode, "M0")]
    for r in range(rounds):
        pair = [("fp32", f"F@{r}"), (mode, f"M@{r}")]
        order += pair if r % 2 == 0 else pair[::-1]
    runs = []
    try:
        start = time.perf_counter()
        for i, (m, label) in enumerate(order):
            policy = Policy(mode=m)
            result = runner(policy, label)
            if result.outcome != "ok":
                raise SystemExit(f"{label} ({m}) failed: {result.outcome}: {result.reason}")
            ev = evaluate(label, policy, result, None)
            runs.append({"index": i, "label": label, "mode": m, "goodput": ev.goodput,
                         "round": None if "@" not in label else int(label.split("@")[1]),
                         "spread": step_spread(result.step_times, result.warmup_steps), "wall_s": round(result.wall_s, 3),
                         "at_s": round(time.perf_counter() - start, 3)})
    finally:
        runner.close()
    return runs


def figures(runs: list[dict], mode: str) -> dict:
    """The session's `trial` figure, paired figure, first-trial and slot effects."""
    by = {r["label"]: r for r in runs}
    rounds = sorted({r["round"] for r in runs if r["round"] is not None})
    fp = [by[f"F@{k}"]["goodput"] for k in rounds]
    mm = [by[f"M@{k}"]["goodput"] for k in rounds]
    gap = paired_gap(mm, fp) if len(rounds) >= 2 else None

    def in_slot(m: str, first: bool) -> list[float]:
        """``m``'s goodputs in the rounds where it ran first (fp32 leads the even rounds), or second."""
        return [by[f"{'F' if m == 'fp32' else 'M'}@{k}"]["goodput"] for k in rounds
                if ((k % 2 == 0) == (m == "fp32")) == first]

    slot = {m: statistics.median(in_slot(m, True)) / statistics.median(in_slot(m, False))
            for m in ("fp32", mode) if in_slot(m, True) and in_slot(m, False)}
    return {
        "trial": by["M0"]["goodput"] / by["F0"]["goodput"],
        "paired": None if gap is None else gap.ratio,
        "paired_low": None if gap is None else gap.low,
        "paired_high": None if gap is None else gap.high,
        "first_fp32_vs_rounds": by["F0"]["goodput"] / statistics.median(fp),
        "second_fp32_vs_rounds": by["F1"]["goodput"] / statistics.median(fp),
        "first_mode_vs_rounds": by["M0"]["goodput"] / statistics.median(mm),
        "slot_first_over_second": slot,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("script", type=Path)
    parser.add_argument("--mode", default="bf16-mixed")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved pairs after F0 F1 M0 (default 6)")
    parser.add_argument("--sessions", type=int, default=3, help="sequences, each with its own warm server")
    parser.add_argument("--steps", type=int, help="measured steps per trial (default: the tune's)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per trial (default: the tune's)")
    parser.add_argument("--json", type=Path, help="write the results here")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    script_args = argv[cut + 1:]  # after --: the script's arguments
    if args.rounds < 2:
        raise SystemExit("--rounds must be at least 2: the paired figure needs two pairs")
    if not args.script.is_file():
        raise SystemExit(f"{args.script}: no such file")
    options = TuneOptions().with_(**{k: v for k, v in (("steps", args.steps), ("warmup", args.warmup)) if v is not None})

    sessions = []
    for s in range(args.sessions):
        runs = session(args.script.resolve(), script_args, args.mode, args.rounds, options)
        sessions.append({"runs": runs, "figures": figures(runs, args.mode)})
        print(f"session {s + 1}/{args.sessions} done", file=sys.stderr)

    def med(key: str) -> float:
        return statistics.median(s["figures"][key] for s in sessions)

    print(f"{args.script} {' '.join(script_args)}: {args.mode} over fp32, {args.sessions} sessions of "
          f"F0 F1 M0 + {args.rounds} alternating pairs ({platform.machine()}, {os.cpu_count()} cores)")
    print(f"{'figure':<46}{'median':>8}  per session")
    rows = [("trial: M0 / F0", "trial"), ("paired over the rounds", "paired"),
            ("F0 (first trial) / fp32 in the rounds", "first_fp32_vs_rounds"),
            ("F1 (second trial) / fp32 in the rounds", "second_fp32_vs_rounds"),
            ("M0 (third trial) / mode in the rounds", "first_mode_vs_rounds")]
    for name, key in rows:
        each = ", ".join(f"{s['figures'][key]:.3f}" for s in sessions)
        print(f"{name:<46}{med(key):>8.3f}  {each}")
    for m in ("fp32", args.mode):
        vals = [s["figures"]["slot_first_over_second"].get(m) for s in sessions]
        vals = [v for v in vals if v is not None]
        if vals:
            print(f"{m + ': first in its pair / second':<46}{statistics.median(vals):>8.3f}  "
                  f"{', '.join(f'{v:.3f}' for v in vals)}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_file_atomic(args.json, json.dumps({
            "script": str(args.script), "args": script_args, "mode": args.mode, "rounds": args.rounds,
            "steps": options.steps, "warmup": options.warmup,
            "machine": machine(),
            "sessions": sessions,
        }, indent=2))


if __name__ == "__main__":
    main()
