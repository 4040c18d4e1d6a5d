"""The verdict zoo: its manifest, its truth rule, and one way to run its cases.

Shared by ``scripts/verdict_truth.py`` (which establishes each case's truth from long runs),
``scripts/bench_verdicts.py`` (which scores mpadvise's short-trial verdicts against it) and
``tests/integration/test_verdict_zoo.py`` (the cheap half, in CI). Nothing here judges with
mpadvise's own stability code: a trial is run through the CLI only to record the raw loss
curves (``mpadvise trial --json``), and the truth comes from ``truth_of`` below, a rule a person
can check by hand on the numbers it records.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
MANIFEST = HERE / "cases.toml"
TRUTH = HERE / "truth.json"

STABLE, UNSTABLE = "stable", "unstable"

# ---- the truth rule -----------------------------------------------------------------------
#
# Applied to the raw per-step losses of fp32 and of the candidate (same seed, same data order),
# every recorded step including the warm-up. Levels are medians of the finite losses in a
# window of 10% of the steps (at least 5): the start level over the first window, the end
# level over the last. The candidate is unstable when
#   1. any loss in its last window is NaN/inf, or more than 10% of all its losses are; or
#   2. its end level is more than 1.5 times fp32's end level; or
#   3. fp32's loss fell by at least 10% of its start level, and the candidate's own fall
#      (start level minus end level) is less than half of fp32's fall;
# otherwise it is stable. No case whose truth is "stable" has a loss heading to zero (where
# two correct runs can end a factor apart): each settles at a floor set by its data.
#
# A truth must be clear-cut, far from those limits, or the case is redesigned:
#   stable:   no NaN/inf at all, end ratio <= 1.2 and (when judged) fall ratio >= 0.8;
#   unstable: rule 1 holds, or end ratio >= 3, or (when judged) fall ratio <= 0.25.

WINDOW_FRACTION, MIN_WINDOW = 0.10, 5
MAX_NONFINITE_FRACTION = 0.10
END_RATIO_LIMIT = 1.5
MIN_REFERENCE_FALL = 0.10
FALL_RATIO_LIMIT = 0.5
CLEAR_STABLE_END_RATIO, CLEAR_STABLE_FALL_RATIO = 1.2, 0.8
CLEAR_UNSTABLE_END_RATIO, CLEAR_UNSTABLE_FALL_RATIO = 3.0, 0.25

RULE_TEXT = (
    "levels: medians of the finite losses over the first and the last 10% of the steps (at "
    "least 5). unstable if (1) a NaN/inf loss in the last window or in more than 10% of the "
    "steps, (2) end level > 1.5 x fp32's end level, or (3) fp32 fell by >= 10% of its start "
    "and the candidate's fall < 0.5 x fp32's fall; else stable. clear-cut only if a stable "
    "truth has no NaN/inf, end ratio <= 1.2 and fall ratio >= 0.8, and an unstable one has "
    "(1), end ratio >= 3 or fall ratio <= 0.25"
)


def as_float(value: Any) -> float:
    """A loss from trial JSON, where NaN/inf are strings."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _median(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def _round(value: float, digits: int = 4) -> float | str:
    if not math.isfinite(value):
        return str(value)
    return float(f"{value:.{digits}g}")


@dataclass(frozen=True)
class Truth:
    """What the rule says of one candidate against fp32, and the numbers it said it from."""

    truth: str
    reason: str
    clear: bool
    figures: dict[str, Any]


def truth_of(reference: Sequence[float], candidate: Sequence[float]) -> Truth:
    """The truth rule above, on two raw loss curves (compared over their common length)."""
    ref = [as_float(v) for v in reference]
    cand = [as_float(v) for v in candidate]
    n = min(len(ref), len(cand))
    if n < 2 * MIN_WINDOW:
        return Truth(UNSTABLE, f"only {n} steps recorded", False, {"steps": n})
    ref, cand = ref[:n], cand[:n]
    window = max(MIN_WINDOW, int(n * WINDOW_FRACTION))
    ref_start, ref_end = _median(ref[:window]), _median(ref[-window:])
    cand_start, cand_end = _median(cand[:window]), _median(cand[-window:])
    nonfinite = sum(1 for v in cand if not math.isfinite(v))
    nonfinite_last = sum(1 for v in cand[-window:] if not math.isfinite(v))
    first_bad = next((i + 1 for i, v in enumerate(cand) if not math.isfinite(v)), None)
    ref_fall = ref_start - ref_end
    judged_fall = math.isfinite(ref_fall) and ref_fall >= MIN_REFERENCE_FALL * abs(ref_start)
    fall_ratio = (cand_start - cand_end) / ref_fall if judged_fall else math.nan
    end_ratio = cand_end / ref_end if ref_end > 0 else math.nan
    figures: dict[str, Any] = {
        "steps": n,
        "window": window,
        "fp32_start": _round(ref_start),
        "fp32_end": _round(ref_end),
        "candidate_start": _round(cand_start),
        "candidate_end": _round(cand_end),
        "end_ratio": _round(end_ratio, 3),
        "fall_ratio": _round(fall_ratio, 3) if judged_fall else None,
        "nonfinite_steps": nonfinite,
        "first_nonfinite_step": first_bad,
    }
    reasons = []
    if nonfinite_last or nonfinite > MAX_NONFINITE_FRACTION * n or not math.isfinite(cand_end):
        reasons.append(f"non-finite loss on {nonfinite} of {n} steps (first at step {first_bad})")
    if math.isfinite(end_ratio) and end_ratio > END_RATIO_LIMIT:
        reasons.append(f"ends at {end_ratio:.3g} x fp32's level ({cand_end:.4g} against {ref_end:.4g})")
    if judged_fall and math.isfinite(fall_ratio) and fall_ratio < FALL_RATIO_LIMIT:
        reasons.append(f"fell {fall_ratio:.0%} as far as fp32 ({cand_start:.4g} -> {cand_end:.4g} "
                       f"against {ref_start:.4g} -> {ref_end:.4g})")
    if reasons:
        clear = bool(
            reasons[0].startswith("non-finite")
            or (math.isfinite(end_ratio) and end_ratio >= CLEAR_UNSTABLE_END_RATIO)
            or (judged_fall and fall_ratio <= CLEAR_UNSTABLE_FALL_RATIO)
        )
        return Truth(UNSTABLE, "; ".join(reasons), clear, figures)
    clear = (nonfinite == 0 and math.isfinite(end_ratio) and end_ratio <= CLEAR_STABLE_END_RATIO
             and (not judged_fall or fall_ratio >= CLEAR_STABLE_FALL_RATIO))
    fall = f", fell {fall_ratio:.0%} as far" if judged_fall else ", fp32's fall too small to judge"
    return Truth(STABLE, f"ends at {end_ratio:.3g} x fp32's level{fall}", clear, figures)


# ---- the manifest -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One script of the zoo and what is known about it."""

    name: str
    script: Path
    modes: dict[str, str]  # mode -> expected truth, "stable" or "unstable"
    steps: int  # the bench's trial window: measured steps ...
    warmup: int  # ... after these warm-up steps
    truth_steps: int  # measured steps of the long runs that set the truth
    cheap: bool
    why: str = ""
    args: tuple[str, ...] = field(default=())


def load_cases(path: Path = MANIFEST) -> list[Case]:
    data = tomllib.loads(path.read_text())
    defaults = data.get("defaults", {})
    cases = []
    for name, entry in data["cases"].items():
        merged = {**defaults, **entry}
        modes = dict(merged["modes"])
        bad = {m: t for m, t in modes.items() if t not in (STABLE, UNSTABLE)}
        if bad:
            raise ValueError(f"{name}: expected truths must be stable or unstable, not {bad}")
        case = Case(
            name=name,
            script=HERE / merged.get("script", f"{name}.py"),
            modes=modes,
            steps=int(merged["steps"]),
            warmup=int(merged["warmup"]),
            truth_steps=int(merged["truth_steps"]),
            cheap=bool(merged["cheap"]),
            why=str(merged.get("why", "")),
            args=tuple(str(a) for a in merged.get("args", ())),
        )
        if not case.script.is_file():
            raise ValueError(f"{name}: no script {case.script}")
        cases.append(case)
    return cases


def select(cases: list[Case], *, cheap: bool = False, names: Sequence[str] = ()) -> list[Case]:
    unknown = set(names) - {c.name for c in cases}
    if unknown:
        raise SystemExit(f"unknown cases: {', '.join(sorted(unknown))}")
    return [c for c in cases if (not cheap or c.cheap) and (not names or c.name in names)]


def load_truth(path: Path = TRUTH) -> dict[str, dict[str, dict[str, Any]]]:
    return json.loads(path.read_text())["cases"]


# ---- running a trial ----------------------------------------------------------------------


def trial_command(case: Case, *, steps: int, warmup: int, timeout: float | None = None) -> list[str]:
    """``python -m advisor.cli trial SCRIPT -m MODE... --steps N --warmup W --json``."""
    cmd = [sys.executable, "-m", "advisor.cli", "trial", str(case.script.relative_to(ROOT))]
    for mode in case.modes:
        cmd += ["-m", mode]
    cmd += ["--steps", str(steps), "--warmup", str(warmup), "--json"]
    if timeout is not None:
        cmd += ["--timeout", str(timeout)]
    if case.args:
        cmd += ["--", *case.args]
    return cmd


def shown(cmd: Sequence[str]) -> str:
    """The command as a person would type it from the repository root."""
    words = list(cmd)
    if words[:3] == [sys.executable, "-m", "advisor.cli"]:
        words = ["mpadvise", *words[3:]]
    return shlex.join(words)


@dataclass
class TrialRun:
    command: list[str]
    returncode: int
    wall_s: float
    payload: dict[str, Any] | None
    stderr_tail: str

    @property
    def error(self) -> str:
        """Why the run gave no comparison ('' when it did)."""
        if self.payload is None:
            return f"mpadvise trial exited {self.returncode} without JSON: {self.stderr_tail}"
        if self.returncode not in (0, 3):
            return f"mpadvise trial exited {self.returncode}: {self.stderr_tail}"
        return ""

    def reference_losses(self) -> list[float]:
        assert self.payload is not None
        return [as_float(v) for v in self.payload["reference"]["losses"]]

    def candidates(self) -> dict[str, dict[str, Any]]:
        assert self.payload is not None
        return {c["mode"]: c for c in self.payload["candidates"]}


def run_trial(command: list[str], *, timeout: float, home: Path | None = None) -> TrialRun:
    """Run one ``mpadvise trial --json`` from the repository root, with its own fresh cache."""
    with tempfile.TemporaryDirectory(prefix="mpadvise-zoo-") as tmp:
        env = dict(os.environ)
        env["MPADVISE_HOME"] = str(home or Path(tmp) / "home")
        env.pop("MPADVISE_POLICY", None)
        start = time.monotonic()
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        wall = time.monotonic() - start
    payload = None
    text = proc.stdout
    if "{" in text:
        try:
            payload = json.loads(text[text.index("{"):])
        except json.JSONDecodeError:
            payload = None
    return TrialRun(command, proc.returncode, wall, payload, proc.stderr[-2000:])


# ---- scoring the short trials -------------------------------------------------------------


@dataclass
class Scored:
    case: str
    mode: str
    truth: str
    verdict: str  # "stable", "unstable" or "error"
    outcome: str
    reason: str
    window_truth: str  # the truth rule applied to the trial's own, short curves
    wall_s: float

    @property
    def false_stable(self) -> bool:
        return self.truth == UNSTABLE and self.verdict == STABLE

    @property
    def false_unstable(self) -> bool:
        return self.truth == STABLE and self.verdict == UNSTABLE

    def to_dict(self) -> dict[str, Any]:
        return {
            "case": self.case, "mode": self.mode, "truth": self.truth, "verdict": self.verdict,
            "outcome": self.outcome, "reason": self.reason, "window_truth": self.window_truth,
            "correct": self.verdict == self.truth, "wall_s": round(self.wall_s, 1),
        }


def verdict_of(candidate: dict[str, Any]) -> str:
    """mpadvise's verdict on one candidate: stable, unstable, or error (crash, timeout, ...)."""
    outcome = candidate.get("outcome")
    if outcome == "ok" and candidate.get("stable"):
        return STABLE
    if outcome == "unstable":
        return UNSTABLE
    return "error"


def score_case(case: Case, truth: dict[str, dict[str, Any]], *, steps: int | None = None,
               timeout: float = 900) -> tuple[list[Scored], TrialRun]:
    """Run the case's short trial (its manifest window unless ``steps``) and score each mode."""
    command = trial_command(case, steps=steps or case.steps, warmup=case.warmup)
    run = run_trial(command, timeout=timeout)
    scored = []
    for mode in case.modes:
        known = truth.get(case.name, {}).get(mode)
        if known is None:
            raise SystemExit(f"{case.name}: no recorded truth for {mode}; run scripts/verdict_truth.py")
        if run.error:
            scored.append(Scored(case.name, mode, known["truth"], "error", "error", run.error, "?", run.wall_s))
            continue
        cand = run.candidates().get(mode)
        if cand is None:
            scored.append(Scored(case.name, mode, known["truth"], "error", "missing",
                                 "no such candidate in the trial's JSON", "?", run.wall_s))
            continue
        window = truth_of(run.reference_losses(), [as_float(v) for v in cand["losses"]]).truth
        scored.append(Scored(case.name, mode, known["truth"], verdict_of(cand), str(cand.get("outcome")),
                             str(cand.get("reason") or ""), window, run.wall_s))
    return scored, run


def summarise(scored: Sequence[Scored]) -> dict[str, dict[str, Any]]:
    """Per mode: how many were judged, and which cases were falsely stable, unstable, errors."""
    table: dict[str, dict[str, Any]] = {}
    for s in scored:
        row = table.setdefault(s.mode, {"cases": 0, "false_stable": [], "false_unstable": [], "errors": []})
        row["cases"] += 1
        if s.false_stable:
            row["false_stable"].append(s.case)
        elif s.false_unstable:
            row["false_unstable"].append(s.case)
        elif s.verdict == "error":
            row["errors"].append(s.case)
    return dict(sorted(table.items()))
