"""Establish the truth of each case of the verdict zoo (tests/verdicts) from long runs.

For each case, one long ``mpadvise trial CASE -m MODE... --steps N --warmup 5 --json`` (N from
the manifest's ``truth_steps``, several hundred steps) records the raw per-step losses of fp32
and of every mode the case names. mpadvise's verdicts in that output are ignored: the truth is
the simple rule in tests/verdicts/zoo.py (``truth_of``) applied to the long curves:

- levels are medians of the finite losses over the first and the last 10% of the steps;
- unstable if a NaN/inf loss falls in the last window (or on more than 10% of the steps), if
  the candidate ends above 1.5 times fp32's end level, or if fp32 fell by at least 10% and the
  candidate fell less than half as far; otherwise stable;
- and the truth must be clear-cut: a stable mode ends within 1.2 times fp32's level having
  fallen at least 80% as far, with no NaN/inf; an unstable one is NaN/inf, ends at 3 times
  fp32's level or more, or falls at most 25% as far. Anything in between is not a known truth,
  and the case has to be redesigned.

It writes tests/verdicts/truth.json (case -> mode -> truth, reason, figures, command) and the
same figures into a "Truth" paragraph at the end of each script's docstring, and exits 1 when a
truth differs from what the manifest expects or is not clear-cut.

    nice .venv/bin/python scripts/verdict_truth.py [--case NAME ...] [--cheap] [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "verdicts"))

import zoo  # noqa: E402

from probes import write_file_atomic  # noqa: E402

MARKER = "Truth (scripts/verdict_truth.py"


def profile(losses: list[float], parts: int = 10) -> list[float | str]:
    """The curve in ``parts`` medians of equal stretches: enough to see its shape by eye."""
    size = max(1, len(losses) // parts)
    out: list[float | str] = []
    for i in range(0, size * parts, size):
        chunk = [v for v in losses[i : i + size] if math.isfinite(v)]
        out.append(float(f"{statistics.median(chunk):.4g}") if chunk else "nan")
    return out


def _g(value):
    """A figure as a person reads it: 1.04e+09, 0.8641, 605."""
    return f"{value:.4g}" if isinstance(value, float) else value


def docstring_block(case: zoo.Case, records: dict[str, dict], command: str) -> str:
    steps = next(iter(records.values()))["figures"]["steps"]
    lines = [f"{MARKER}: fp32 and each mode, {steps} recorded steps, warm-up included, seed 0):"]
    for mode, rec in records.items():
        f = {k: _g(v) for k, v in rec["figures"].items()}
        fall = "" if f["fall_ratio"] is None else f", fall ratio {f['fall_ratio']}"
        bad = f", {f['nonfinite_steps']} non-finite from step {f['first_nonfinite_step']}" if f["nonfinite_steps"] else ""
        lines.append(f"- {mode}: {rec['truth']}. fp32 {f['fp32_start']} -> {f['fp32_end']}, {mode} "
                     f"{f['candidate_start']} -> {f['candidate_end']}; end ratio {f['end_ratio']}{fall}{bad}.")
    lines.append(f"  {command}")
    return "\n".join(lines)


def write_docstring(path: Path, block: str) -> None:
    """Replace the Truth paragraph (or add one) at the end of the script's docstring."""
    text = path.read_text()
    start = text.index('"""') + 3
    end = text.index('"""', start)
    body = text[start:end]
    if MARKER in body:
        body = body[: body.index(MARKER)]
    body = body.rstrip("\n") + "\n\n" + block + "\n"
    write_file_atomic(path, text[:start] + body + text[end:])


def write_truth(existing: dict) -> None:
    text = json.dumps(existing, indent=1)
    # Flat lists (the curve profiles) on one line each, so the file reads case by case.
    text = re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    write_file_atomic(zoo.TRUTH, text + "\n")


def check(case: zoo.Case, records: dict[str, dict]) -> list[str]:
    """What is wrong with a case's truths: one the manifest does not expect, or not clear-cut."""
    problems = []
    for mode, expected in case.modes.items():
        rec = records.get(mode)
        if rec is None:
            problems.append(f"{case.name} {mode}: no truth recorded")
        elif rec["truth"] != expected:
            problems.append(f"{case.name} {mode}: {rec['truth']}, expected {expected} ({rec['reason']})")
        elif not rec["clear"]:
            problems.append(f"{case.name} {mode}: {rec['truth']} but not clear-cut ({rec['reason']})")
    return problems


def from_record(cases: list[zoo.Case], dry_run: bool) -> int:
    """Check the recorded truths against the manifest and rewrite the docstrings, running nothing."""
    if not dry_run:
        write_truth(json.loads(zoo.TRUTH.read_text()))  # in this script's layout
    recorded = zoo.load_truth()
    problems = []
    for case in cases:
        records = recorded.get(case.name, {})
        problems += check(case, records)
        if records and not dry_run:
            records = {m: records[m] for m in case.modes if m in records}
            write_docstring(case.script, docstring_block(case, records, next(iter(records.values()))["command"]))
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", nargs="*", default=[], help="only these cases")
    parser.add_argument("--cheap", action="store_true", help="only the cheap half")
    parser.add_argument("--steps", type=int, help="measured steps of each long run (default: the manifest's)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per trial")
    parser.add_argument("--dry-run", action="store_true", help="print, write neither truth.json nor docstrings")
    parser.add_argument("--from-record", action="store_true",
                        help="run nothing: check truth.json against the manifest and rewrite the docstrings from it")
    args = parser.parse_args()

    cases = zoo.select(zoo.load_cases(), cheap=args.cheap, names=args.case)
    if args.from_record:
        return from_record(cases, args.dry_run)
    existing = json.loads(zoo.TRUTH.read_text()) if zoo.TRUTH.exists() else {"cases": {}}
    problems: list[str] = []
    began = time.monotonic()
    for case in cases:
        steps = args.steps or case.truth_steps
        cmd = zoo.trial_command(case, steps=steps, warmup=5, timeout=args.timeout)
        shown = zoo.shown(zoo.trial_command(case, steps=steps, warmup=5))  # as a person runs it
        print(f"{case.name}: {shown}", flush=True)
        run = zoo.run_trial(cmd, timeout=args.timeout * (len(case.modes) + 3))
        if run.error:
            problems.append(f"{case.name}: {run.error}")
            print(f"  {run.error}", flush=True)
            continue
        ref = run.reference_losses()
        records: dict[str, dict] = {}
        for mode, expected in case.modes.items():
            losses = [zoo.as_float(v) for v in run.candidates()[mode]["losses"]]
            t = zoo.truth_of(ref, losses)
            records[mode] = {
                "truth": t.truth, "reason": t.reason, "clear": t.clear, "figures": t.figures,
                "command": shown, "profile": {"fp32": profile(ref), mode: profile(losses)},
            }
            flag = ("" if t.truth == expected and t.clear else
                    f"  <-- the manifest expects {expected}" if t.truth != expected else "  <-- not clear-cut")
            print(f"  {mode:12s} {t.truth:9s} {t.reason}{flag}", flush=True)
        problems += check(case, records)
        print(f"  ({run.wall_s:.0f} s)", flush=True)
        existing["cases"][case.name] = records
        existing["rule"] = zoo.RULE_TEXT
        existing["recorded_on"] = {
            "date": datetime.date.today().isoformat(),
            "hardware": run.payload["hardware"]["name"] if run.payload else None,
            "python": platform.python_version(),
            "torch": __import__("torch").__version__,
        }
        if not args.dry_run:
            known = {c.name for c in zoo.load_cases()}
            existing["cases"] = {k: v for k, v in sorted(existing["cases"].items()) if k in known}
            write_truth(existing)
            write_docstring(case.script, docstring_block(case, records, shown))
    print(f"{len(cases)} cases in {time.monotonic() - began:.0f} s")
    for p in problems:
        print(f"PROBLEM: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
