"""The tune's trial book: the yardsticks every verdict is judged against (the fp32 reference and
its replicate, fp32 with its initial parameters perturbed by about one bf16 rounding, whose drift
widens the stability limits) and every candidate run and judged."""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from advisor._log import get_logger
from advisor.trial import TrialResult, json_float
from advisor.tune._judge import Evaluation, ReferenceTrialError, check_reference, curve_of, evaluate
from advisor.tune._run import Extendable, Perturbable, Runner, limit_memory
from advisor.tune._space import Candidate, Measured
from advisor.tune._spread import still_falling
from advisor.tune._stability import StabilityThresholds, TrialCurve, judge
from policies import Policy

# How many times the window asked for may grow while fp32's loss still falls geometrically.
MAX_WINDOW_GROWTH = 8
# A stall this many times fp32's measured spread would forgive gets a second replicate: one draw of
# a normally distributed drift comes out under an eighth of the typical one about one time in ten
# (tests/integration/scripts/noisy_small_drop.py: 0.036 and 0.015, then 0.111), two about 1 in 100.
SECOND_LOOK_MULTIPLE = 8.0
# The coarsest of the 16-bit formats a candidate computes in (2^-8 of a value at most).
REPLICATE_PERTURBATION = "bf16"


@dataclass(frozen=True)
class Replicate:
    """fp32 run again with each initial parameter multiplied once by ``1 + u * 2^-8``; kept with
    the study for ``--resume``. ``identical``: its losses are fp32's bit for bit (the script set
    the weights after ``setup()``). ``draw`` is 1 for the second one a narrow stall asks for."""

    seed: int
    losses: tuple[float, ...] = ()
    wall_s: float = 0.0
    note: str = ""
    reused: bool = False
    perturb: str = REPLICATE_PERTURBATION
    identical: bool = False
    result: TrialResult | None = dataclasses.field(default=None, compare=False, repr=False)
    draw: int = 0

    @property
    def label(self) -> str:
        which = "replicate" if self.draw == 0 else f"replicate {self.draw + 1}"
        return f"fp32 ({which}, {self.perturb}-perturbed)"

    @property
    def curve(self) -> TrialCurve | None:
        return TrialCurve(mode="fp32", losses=self.losses) if self.losses and not self.note else None

    def to_dict(self, *, losses: bool = True) -> dict[str, Any]:
        data: dict[str, Any] = {"seed": self.seed, "perturb": self.perturb, "steps": len(self.losses),
                                "wall_s": self.wall_s, "note": self.note, "reused": self.reused,
                                "identical": self.identical, "draw": self.draw}
        if losses:
            data["losses"] = [json_float(v) for v in self.losses]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Replicate | None:
        """Inverse of ``to_dict``, or ``None`` (one without ``perturb`` ran under another seed)."""
        try:
            losses = tuple(float(v) for v in data["losses"])
            seed, wall = int(data["seed"]), float(data.get("wall_s") or 0.0)
            perturb = str(data["perturb"])
            draw = int(data.get("draw") or 0)
        except (KeyError, TypeError, ValueError):
            return None
        if data.get("note") or not losses or not all(math.isfinite(v) for v in losses):
            return None
        return cls(seed, losses, wall, perturb=perturb, identical=bool(data.get("identical")), draw=draw)

    @classmethod
    def from_result(cls, result: TrialResult, seed: int, reference: TrialResult,
                    draw: int = 0) -> Replicate:
        second = "second " if draw else ""
        label = f"the {second}fp32 replicate ({REPLICATE_PERTURBATION}-perturbed)"
        bad = next((i for i, v in enumerate(result.losses) if not math.isfinite(v)), None)
        note = ""
        if result.outcome != "ok":
            note = f"{label} failed ({result.outcome}): {result.reason}"
        elif bad is not None:
            note = (f"{label} reached a {result.losses[bad]} loss at step {bad + 1}: fp32 itself diverges "
                    "after a perturbation the size of one rounding; a lower learning rate would make the "
                    "verdicts firmer")
        elif len(result.losses) < len(reference.losses):
            note = f"{label} recorded {len(result.losses)} steps, fewer than the reference's {len(reference.losses)}"
        if note:
            get_logger().warning(f"{note}; the stability verdicts use the fixed limits")
        identical = not note and tuple(result.losses[: len(reference.losses)]) == tuple(reference.losses)
        if identical:
            get_logger().warning(
                f"{label} trained bit for bit as fp32: its perturbation never reached the trained weights (does the "
                "script set them after setup(), from a checkpoint or its own initialisation?); the stability verdicts "
                "use the fixed limits")
        return cls(seed, () if note else tuple(result.losses), result.wall_s or 0.0, note,
                   identical=identical, result=result, draw=draw)


def run_replicate(
    runner: Runner, reference: TrialResult, *, stored: Mapping[str, Any] | None = None,
    on_start: Callable[[str], None] | None = None, draw: int = 0,
) -> Replicate | None:
    """fp32 again, perturbed, or the ``stored`` replicate of the same seed, draw and steps."""
    if not isinstance(runner, Perturbable):
        return None
    kept = Replicate.from_dict(stored) if stored else None
    same = (runner.seed, REPLICATE_PERTURBATION, draw, len(reference.losses))
    if kept is not None and (kept.seed, kept.perturb, kept.draw, len(kept.losses)) == same:
        return dataclasses.replace(kept, reused=True)
    label = Replicate(runner.seed, draw=draw).label
    if on_start:
        on_start(label)
    result = runner.perturbed(REPLICATE_PERTURBATION, draw=draw)(Policy(mode="fp32"), label)
    return Replicate.from_result(result, runner.seed, reference, draw)


class Reference(NamedTuple):
    """fp32's result, the runner (its window maybe grown) every later trial uses, and why."""

    result: TrialResult
    runner: Runner
    window_note: str


def run_reference(
    runner: Runner, *, thresholds: StabilityThresholds | None = None, on_start: Callable[[str], None] | None = None,
    deadline: float | None = None, clock: Callable[[], float] = time.monotonic,
) -> Reference:
    """Run fp32; while its loss still falls geometrically at the end of the window, again with
    twice the window (a 16-bit mode's loss floor shows only once fp32 has fallen below it), up to
    ``MAX_WINDOW_GROWTH`` times what was asked and while it fits before ``deadline``."""
    on_start = on_start or (lambda label: None)
    on_start("fp32 (reference)")
    result = runner(Policy(mode="fp32"), "fp32")
    check_reference(result)
    if not isinstance(runner, Extendable):
        return Reference(result, runner, "")
    asked, note = runner.measure_steps, ""
    thresholds = thresholds or StabilityThresholds()
    while True:
        factor = still_falling(result.losses, thresholds.smoothing_window(len(result.losses)))
        if factor is None:
            return Reference(result, runner, note)
        steps = len(result.losses)
        longer = runner.measure_steps * 2
        too_long = longer > asked * MAX_WINDOW_GROWTH
        late = deadline is not None and clock() + 2.0 * (result.wall_s or 0.0) > deadline
        if too_long or late:
            why = (f"the window already grew to {MAX_WINDOW_GROWTH}x the {asked} steps asked" if too_long
                   else "the time budget leaves no room for a longer one")
            return Reference(result, runner, (
                f"the window is short for this workload: fp32's loss was still falling geometrically at its end "
                f"({factor:.1f}x over the last quarter of {steps} steps) and {why}; where the curves level off is "
                f"not seen, so a loss floor may pass; run with more --steps"))
        runner = runner.with_measure_steps(longer)
        note = (f"fp32's loss was still falling geometrically ({factor:.1f}x over the last quarter of {steps} "
                f"steps): every trial measures {longer} steps instead of {asked}, so the curves are compared "
                "where they level off")
        get_logger().info(note)
        on_start(f"fp32 (reference, {longer} steps)")
        result = runner(Policy(mode="fp32"), "fp32")
        check_reference(result)


class Yardsticks:
    """fp32 and its replicate at every window length used. A stable candidate whose gap above fp32
    grows (``bending_away``) runs again with twice the window, beside fp32 and the replicate at that
    length, until it levels off, fails or the window cannot grow; a narrow stall is judged again
    against a second replicate."""

    def __init__(self, runner: Runner, reference: TrialResult, replicate: Replicate | None, *,
                 thresholds: StabilityThresholds | None = None, asked: int | None = None,
                 deadline: float | None = None, clock: Callable[[], float] = time.monotonic,
                 on_start: Callable[[str], None] | None = None) -> None:
        self.runner = runner
        self.thresholds = thresholds or StabilityThresholds()
        self.asked = asked if asked is not None else getattr(runner, "measure_steps", None)
        self.deadline, self.clock, self.on_start = deadline, clock, on_start or (lambda label: None)
        self.steps = getattr(runner, "measure_steps", None)
        self._at: dict[int | None, tuple[TrialResult, TrialCurve | None]] = {
            self.steps: (reference, None if replicate is None else replicate.curve)}
        self._second: dict[int | None, Replicate | None] = {}
        self.extended: list[str] = []

    def evaluate(self, label: str, policy: Policy, result: TrialResult) -> Evaluation:
        reference, curve = self._at[self.steps]
        ev = evaluate(label, policy, result, reference, thresholds=self.thresholds, replicate=curve)
        steps = self.steps
        while (ev.stable and ev.verdict and ev.verdict.metrics.get("bending_away")
               and self._can_grow(steps, ev.result)):
            steps = steps * 2  # type: ignore[operator]  # _can_grow checked it is an int
            at = self._yardstick(steps)
            if at is None:
                break
            reference, curve = at
            longer = f"{label} ({steps} steps)"
            self.extended.append(label)
            self.on_start(longer)
            ran = self.runner.with_measure_steps(steps)(policy, longer)  # type: ignore[attr-defined]
            ev = evaluate(label, policy, ran, reference, thresholds=self.thresholds, replicate=curve)
        return self.second_look(ev, steps)

    def second_replicate(self) -> Replicate | None:
        return self._second.get(self.steps)

    def second_look(self, ev: Evaluation, steps: int | None = None) -> Evaluation:
        """``ev`` judged again against a second replicate when it is a narrow stall."""
        steps = self.steps if steps is None else steps
        reference, curve = self._at.get(steps, (None, None))
        if reference is None or curve is None or not _narrow_stall(ev, reference, curve, self.thresholds):
            return ev
        if steps not in self._second:
            runner = self.runner if steps == self.steps else self.runner.with_measure_steps(steps)  # type: ignore[attr-defined]
            self._second[steps] = run_replicate(runner, reference, on_start=self.on_start, draw=1)
        second = self._second[steps]
        if second is None or second.curve is None:
            return ev
        again = evaluate(ev.label, ev.policy, ev.result, reference, thresholds=self.thresholds, replicate=second.curve)
        return _judged_twice(ev, again, second)

    def _can_grow(self, steps: int | None, last: TrialResult) -> bool:
        if (steps is None or self.asked is None or not isinstance(self.runner, Extendable)
                or steps * 2 > self.asked * MAX_WINDOW_GROWTH):
            return False
        # fp32, its replicate (unless run already) and the candidate, each twice as long as the last.
        cost = 3 * 2.0 * (last.wall_s or 0.0)
        return self.deadline is None or self.clock() + cost <= self.deadline

    def _yardstick(self, steps: int) -> tuple[TrialResult, TrialCurve | None] | None:
        """fp32 and its replicate at ``steps``, run on first use (``None`` where fp32 fails)."""
        if steps not in self._at:
            runner = self.runner.with_measure_steps(steps)  # type: ignore[attr-defined]
            label = f"fp32 (reference, {steps} steps)"
            self.on_start(label)
            reference = runner(Policy(mode="fp32"), label)
            try:
                check_reference(reference)
            except ReferenceTrialError as exc:
                get_logger().warning(f"{label} failed, so the window stays shorter: {exc}")
                return None
            replicate = run_replicate(runner, reference, on_start=self.on_start)
            self._at[steps] = (reference, None if replicate is None else replicate.curve)
        return self._at[steps]


def _narrow_stall(ev: Evaluation, reference: TrialResult, replicate: TrialCurve,
                  thresholds: StabilityThresholds) -> bool:
    if ev.verdict is None or ev.verdict.kind != "stalled" or ev.result.outcome != "ok":
        return False
    wider = dataclasses.replace(thresholds, spread_multiplier=thresholds.spread_multiplier * SECOND_LOOK_MULTIPLE)
    return judge(curve_of(ev.result, ev.policy.mode), curve_of(reference, "fp32"), wider, replicate=replicate).stable


def _judged_twice(first: Evaluation, again: Evaluation, second: Replicate) -> Evaluation:
    """The evaluation against the replicate that allows the candidate, saying both were run."""
    if first.verdict is None or again.verdict is None:
        return first
    if again.stable:
        base, verdict = again, again.verdict
        clause = (f"; judged against {second.label}, since against the first replicate, which "
                  f"strayed less, it was {first.verdict.kind}")
    else:
        base, verdict = first, first.verdict
        clause = f"; {second.label} strayed no further than that allows"
    verdict = dataclasses.replace(verdict, reason=verdict.reason + clause, metrics={**verdict.metrics, "replicates": 2})
    return dataclasses.replace(base, verdict=verdict)


class Comparison(NamedTuple):
    reference: Evaluation
    evaluations: list[Evaluation]
    replicate: Replicate | None
    window_note: str = ""
    measure_steps: int | None = None
    second_replicate: Replicate | None = None

    def judged_against(self) -> dict[str, TrialCurve]:
        """By label, the second replicate's curve for each evaluation judged stable against it."""
        second = None if self.second_replicate is None else self.second_replicate.curve
        if second is None:
            return {}
        return {ev.label: second for ev in self.evaluations
                if ev.stable and ev.verdict and ev.verdict.metrics.get("replicates") == 2}


def run_comparison(
    runner: Runner, candidates: list[tuple[Policy, str]], *, thresholds: StabilityThresholds | None = None,
    on_start: Callable[[int, str], None] | None = None, on_done: Callable[[int, Evaluation], None] | None = None,
) -> Comparison:
    """``mpadvise trial``'s comparison: fp32, its replicate, then each candidate judged by them."""
    fp32 = Policy(mode="fp32")
    asked = runner.measure_steps if isinstance(runner, Extendable) else None
    ref_result, runner, window_note = run_reference(
        runner, thresholds=thresholds, on_start=None if on_start is None else lambda label: on_start(0, label))
    if on_done:
        on_done(0, evaluate("fp32", fp32, ref_result, ref_result, thresholds=thresholds))
    replicate = run_replicate(runner, ref_result, on_start=None if on_start is None else lambda label: on_start(1, label))
    if replicate is not None and replicate.result is not None and on_done:
        on_done(1, evaluate(replicate.label, fp32, replicate.result, None, thresholds=thresholds))
    reference = evaluate("fp32", fp32, ref_result, ref_result, thresholds=thresholds,
                         replicate=None if replicate is None else replicate.curve)
    evaluations = []
    first = 1 if replicate is None else 2
    index = first
    yardsticks = Yardsticks(runner, ref_result, replicate, thresholds=thresholds, asked=asked,
                            on_start=None if on_start is None else lambda label: on_start(index, label))
    for i, (policy, label) in enumerate(candidates, start=first):
        index = i
        if on_start:
            on_start(i, label)
        evaluation = yardsticks.evaluate(label, policy, runner(policy, label))
        evaluations.append(evaluation)
        if on_done:
            on_done(i, evaluation)
    steps = runner.measure_steps if isinstance(runner, Extendable) else None
    return Comparison(reference, evaluations, replicate, window_note, steps, yardsticks.second_replicate())


@dataclass
class Trials:
    """Runs candidates and judges each against the fp32 reference, keeping every evaluation."""

    runner: Runner
    thresholds: StabilityThresholds
    memory_limit: int | None
    on_start: Callable[[str], None] | None
    on_done: Callable[[str, Evaluation | None, Measured], None] | None
    evaluations: dict[Candidate, Evaluation] = field(default_factory=dict)
    reference: TrialResult | None = None
    replicate: Replicate | None = None
    window_note: str = ""  # how run_reference settled the measured window
    yardsticks: Yardsticks | None = None  # fp32 and its replicate per window, once the replicate ran
    _asked: int | None = None
    _deadline: float | None = None
    _clock: Callable[[], float] = time.monotonic

    @property
    def user_batch(self) -> int | None:
        return None if self.reference is None else self.reference.user_batch

    @property
    def replicate_curve(self) -> TrialCurve | None:
        return None if self.replicate is None else self.replicate.curve

    @property
    def replicate_record(self) -> dict[str, Any] | None:
        return None if self.replicate_curve is None else self.replicate.to_dict()

    def run_reference(self, *, deadline: float | None = None, clock: Callable[[], float] = time.monotonic) -> Evaluation:
        # While fp32's loss still falls geometrically at the window's end, the window grows and
        # every later trial (replicate, candidates, re-measurements) measures the longer one.
        self._asked, self._deadline, self._clock = getattr(self.runner, "measure_steps", None), deadline, clock
        # The reference alone counts a step's FLOPs: every candidate runs the same arithmetic.
        counts = hasattr(self.runner, "with_flop_count")
        runner = self.runner.with_flop_count(True) if counts else self.runner
        result, runner, self.window_note = run_reference(
            runner, thresholds=self.thresholds, on_start=self.on_start, deadline=deadline, clock=clock)
        self.runner = runner.with_flop_count(False) if counts else runner
        self.reference = result
        return evaluate("fp32", Policy(mode="fp32"), result, result, thresholds=self.thresholds)

    def run_replicate(self, stored: dict[str, Any] | None) -> Evaluation:
        """Run fp32 perturbed (or reuse the ``stored`` replicate); returns fp32 judged with it."""
        fp32, reference = Policy(mode="fp32"), self.reference
        assert reference is not None, "run_reference comes first"
        self.replicate = run_replicate(self.runner, reference, stored=stored, on_start=self.on_start)
        # From here on a candidate bending away from fp32 is judged on a longer window.
        self.yardsticks = Yardsticks(self.runner, reference, self.replicate, thresholds=self.thresholds,
                                     asked=self._asked, deadline=self._deadline, clock=self._clock,
                                     on_start=self.on_start)
        ran = None if self.replicate is None else self.replicate.result
        if ran is not None and self.on_done:
            ev = evaluate(self.replicate.label, fp32, ran, None, thresholds=self.thresholds)
            ok = ev.result.outcome == "ok"
            self.on_done(ev.label, ev, Measured(Candidate("fp32", reference.user_batch), ev.goodput or 0.0, ok, ok,
                                                outcome=ev.outcome, reason=ev.reason))
        return evaluate("fp32", fp32, reference, reference, thresholds=self.thresholds, replicate=self.replicate_curve)

    def run(self, cand: Candidate) -> Measured:
        policy = cand.policy(self.user_batch)
        if self.on_start:
            self.on_start(cand.label)
        return self.record(cand, policy, self.runner(policy, cand.label))

    def record(self, cand: Candidate, policy: Policy, result: TrialResult) -> Measured:
        result = limit_memory(result, self.memory_limit)
        if self.yardsticks is not None:
            ev = self.yardsticks.evaluate(cand.label, policy, result)
        else:  # the reference itself, recorded before its replicate ran
            ev = evaluate(cand.label, policy, result, self.reference, thresholds=self.thresholds)
        m = _measured(cand, ev)
        self.evaluations[cand] = ev
        if self.on_done:
            self.on_done(cand.label, ev, m)
        return m

    def run_again(self, cand: Candidate, label: str) -> Evaluation:
        """Run a candidate once more (re-measurement), not recorded as its search run."""
        if self.on_start:
            self.on_start(label)
        policy = cand.policy(self.user_batch)
        result = limit_memory(self.runner(policy, label), self.memory_limit)
        ev = evaluate(label, policy, result, self.reference, thresholds=self.thresholds, replicate=self.replicate_curve)
        if self.yardsticks is not None:
            ev = self.yardsticks.second_look(ev)
        if self.on_done:
            self.on_done(label, ev, _measured(cand, ev))
        return ev


def _measured(cand: Candidate, ev: Evaluation) -> Measured:
    return Measured(cand, ev.goodput or 0.0, feasible=ev.result.outcome == "ok", stable=ev.stable,
                    oom=ev.result.outcome == "oom", outcome=ev.outcome, reason=ev.reason,
                    verdict_kind=ev.verdict.kind if ev.verdict else "")
