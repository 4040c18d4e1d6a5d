"""The yardsticks every verdict is judged against: the fp32 reference and its replicate.

``run_reference`` runs fp32, growing the window while its loss still falls geometrically;
``run_replicate`` runs fp32 again with the same seed and data but its initial parameters
perturbed once by about one bf16 rounding: how far it drifts from fp32 is how much this workload
amplifies a perturbation of precision's size, which widens the stability limits
(``advisor.tune._spread``). ``Yardsticks`` judges a candidate on a longer window while it bends
away from fp32, and a narrow stall against a second replicate; ``run_comparison`` is
``mpadvise trial``'s whole comparison.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from advisor._log import get_logger
from advisor.trial import TrialResult, json_float
from advisor.tune._judge import Evaluation, ReferenceTrialError, check_reference, curve_of, evaluate
from advisor.tune._run import Extendable, Perturbable, Runner
from advisor.tune._spread import still_falling
from advisor.tune._stability import StabilityThresholds, TrialCurve, judge
from policies import Policy

MAX_WINDOW_GROWTH = 8
"""How many times the measured window asked for may grow while fp32's loss is still falling
geometrically at its end: 40 steps become at most 320. A loss that halves every few steps has
long reached fp32's own floor, or a 16-bit mode's, by then."""


SECOND_LOOK_MULTIPLE = 8.0
"""A candidate judged stalled that would be stable were fp32's spread this many times what its
replicate measured gets a second replicate, perturbed by another draw of the same size
(``Yardsticks.second_look``). One replicate is one draw of how far a chaotic run strays: for a
normally distributed drift, one draw comes out under an eighth of the typical distance about one
time in ten, and a stable candidate then fails narrowly against it (on tests/integration/scripts/
noisy_small_drop.py, first replicates measured 0.036 and 0.015 where a second measured 0.111).
The larger of two draws is that small about one time in a hundred. A stall far beyond the spread
costs no extra run."""


REPLICATE_PERTURBATION = "bf16"
"""The format whose rounding perturbs the replicate's initial parameters: bf16's, the coarsest
of the 16-bit formats a candidate computes in (2^-8 of a value at most)."""


@dataclass(frozen=True)
class Replicate:
    """fp32 run again with the same seed and data, its initial parameters perturbed once.

    A candidate starts from fp32's own weights and sees fp32's own batches; it differs only
    numerically. So does the replicate: each parameter is multiplied once by ``1 + u * 2^-8``
    (one bf16 rounding) before the first step. How far it then drifts from fp32 is how much
    this workload amplifies a perturbation of precision's size, the noise a candidate's gap is
    judged against. A tune stores it with its study, so ``--resume`` reuses it.

    Attributes:
        seed: the seed it ran with (the reference's).
        losses: its loss per optimizer step; empty when it gave no usable curve.
        wall_s: how long its trial took, in seconds.
        note: why it gave no usable curve; empty when it did.
        reused: whether it was read back from a stored study rather than run now.
        perturb: the format whose rounding perturbed its initial parameters.
        identical: whether its losses are fp32's, bit for bit: the perturbation never reached
            the trained weights (the script set them after ``setup()``), so it measured no
            spread and the fixed limits stand alone.
        result: the trial's result when it ran in this process (never stored).
        draw: which draw of the perturbation: 0 for the replicate every comparison runs, 1 for
            the second one a narrow stall asks for (``Yardsticks.second_look``).
    """

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
        """The curve that calibrates the verdicts, or ``None`` when there is no usable one."""
        return TrialCurve(mode="fp32", losses=self.losses) if self.losses and not self.note else None

    def to_dict(self, *, losses: bool = True) -> dict[str, Any]:
        """A JSON-ready dict (the losses left out with ``losses=False``); ``from_dict`` reads it."""
        data: dict[str, Any] = {"seed": self.seed, "perturb": self.perturb, "steps": len(self.losses),
                                "wall_s": self.wall_s, "note": self.note, "reused": self.reused,
                                "identical": self.identical, "draw": self.draw}
        if losses:
            data["losses"] = [json_float(v) for v in self.losses]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Replicate | None:
        """Inverse of ``to_dict``; ``None`` for data that does not hold a usable replicate (a
        replicate stored without ``perturb`` ran under another seed, which measured the wrong
        noise, and is not reused)."""
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
                    perturb: str = REPLICATE_PERTURBATION, draw: int = 0) -> Replicate:
        """The replicate a trial gave; one that failed carries a note saying why, and is logged."""
        label = f"the {'second ' if draw else ''}fp32 replicate ({perturb}-perturbed)"
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
        return cls(seed, () if note else tuple(result.losses), result.wall_s or 0.0, note, perturb=perturb,
                   identical=identical, result=result, draw=draw)


def run_replicate(
    runner: Runner,
    reference: TrialResult,
    *,
    stored: Mapping[str, Any] | None = None,
    on_start: Callable[[str], None] | None = None,
    draw: int = 0,
) -> Replicate | None:
    """fp32 again with its initial parameters perturbed, or the stored replicate of the same
    reference.

    Args:
        runner: the runner of the reference; one that cannot perturb (not ``Perturbable``)
            gets no replicate.
        reference: the fp32 reference's result.
        stored: a replicate kept with a study (``Replicate.to_dict``), reused when it has the
            same seed, the same perturbation and the reference's number of steps.
        on_start: called with the replicate's label before it runs.
        draw: which draw of the perturbation (0, or 1 for a second replicate).

    Returns:
        The replicate (possibly one with a note saying why it is unusable), or ``None``.
    """
    if not isinstance(runner, Perturbable):
        return None
    seed, perturb = runner.seed, REPLICATE_PERTURBATION
    kept = Replicate.from_dict(stored) if stored else None
    if (kept is not None and kept.seed == seed and kept.perturb == perturb and kept.draw == draw
            and len(kept.losses) == len(reference.losses)):
        return dataclasses.replace(kept, reused=True)
    label = Replicate(seed, perturb=perturb, draw=draw).label
    if on_start:
        on_start(label)
    runner = runner.perturbed(perturb, draw=draw) if draw else runner.perturbed(perturb)
    return Replicate.from_result(runner(Policy(mode="fp32"), label), seed, reference, perturb, draw)


class Reference(NamedTuple):
    """What ``run_reference`` measured: the fp32 result, the runner (its window extended
    when fp32 was still falling) that every later trial must use, and what was done."""

    result: TrialResult
    runner: Runner
    window_note: str


def run_reference(
    runner: Runner,
    *,
    thresholds: StabilityThresholds | None = None,
    on_start: Callable[[str], None] | None = None,
    deadline: float | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Reference:
    """Run fp32, the yardstick; while its loss is still falling geometrically at the end of the
    window, run it again with twice the window, so the comparison sees where the curves level
    off (a 16-bit mode's loss floor shows only once fp32 has fallen below it).

    The window grows to at most ``MAX_WINDOW_GROWTH`` times what was asked, and only while the
    next, longer reference is expected to end before ``deadline`` (its last run's wall time,
    doubled). When it cannot grow, ``window_note`` says the window is short for this workload.

    Raises:
        MpadviseError: the reference failed or is not finite (no verdict is possible).
    """
    if on_start:
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
        if on_start:
            on_start(f"fp32 (reference, {longer} steps)")
        result = runner(Policy(mode="fp32"), "fp32")
        check_reference(result)


class Yardsticks:
    """fp32 and its replicate at every window length a comparison has used, and the judging of a
    candidate that extends the window while the candidate bends away from fp32.

    A stable candidate whose gap above fp32 more than doubled over the window's second half
    (``bending_away`` in its verdict) may be a stall or a floor that the window ended too soon to
    show. It runs again with twice the window, beside fp32 and the replicate at that window (run
    once per length, shared by every candidate), until it levels off, fails, or the window
    reaches ``MAX_WINDOW_GROWTH`` times what was asked or the time budget; then its verdict keeps
    the note that the window is short.

    A narrow stall is judged again against a second replicate (``second_look``).
    """

    def __init__(self, runner: Runner, reference: TrialResult, replicate: Replicate | None, *,
                 thresholds: StabilityThresholds | None = None, asked: int | None = None,
                 deadline: float | None = None, clock: Callable[[], float] = time.monotonic,
                 on_start: Callable[[str], None] | None = None) -> None:
        self.runner = runner
        self.thresholds = thresholds or StabilityThresholds()
        self.asked = asked if asked is not None else getattr(runner, "measure_steps", None)
        self.deadline, self.clock, self.on_start = deadline, clock, on_start
        self.steps = getattr(runner, "measure_steps", None)
        self._at: dict[int | None, tuple[TrialResult, TrialCurve | None]] = {
            self.steps: (reference, None if replicate is None else replicate.curve)}
        self._second: dict[int | None, Replicate | None] = {}
        self.extended: list[str] = []

    def evaluate(self, label: str, policy: Policy, result: TrialResult) -> Evaluation:
        """Judge ``result`` against fp32 at its window, extending the window while it bends away."""
        reference, curve = self._at[self.steps]
        ev = evaluate(label, policy, result, reference, thresholds=self.thresholds, replicate=curve)
        steps = self.steps
        while self._bending(ev) and self._can_grow(steps, ev.result):
            steps = steps * 2  # type: ignore[operator]  # _can_grow checked it is an int
            at = self._yardstick(steps)
            if at is None:
                break
            reference, curve = at
            longer = f"{label} ({steps} steps)"
            self.extended.append(label)
            if self.on_start:
                self.on_start(longer)
            ran = self.runner.with_measure_steps(steps)(policy, longer)  # type: ignore[attr-defined]
            ev = evaluate(label, policy, ran, reference, thresholds=self.thresholds, replicate=curve)
        return self.second_look(ev, steps)

    def second_replicate(self, steps: int | None = None) -> Replicate | None:
        """The second replicate at ``steps`` (the comparison's window when ``None``), if a narrow
        stall ran one there."""
        return self._second.get(self.steps if steps is None else steps)

    def second_look(self, ev: Evaluation, steps: int | None = None) -> Evaluation:
        """``ev`` judged again against a second replicate, when it is a narrow stall.

        A stall that ``SECOND_LOOK_MULTIPLE`` times fp32's measured spread would forgive may be
        one replicate's draw coming out small. A second replicate, perturbed by another draw,
        runs once per window (shared by every candidate), and the candidate is stable if it is
        stable against either: the limits then come from the wider of the two draws. Anything
        else is returned as it is.

        Args:
            ev: the evaluation against fp32 and the first replicate at ``steps``.
            steps: the window it was measured over; the comparison's own when ``None``.
        """
        steps = self.steps if steps is None else steps
        reference, curve = self._at.get(steps, (None, None))
        if reference is None or curve is None or not _narrow_stall(ev, reference, curve, self.thresholds):
            return ev
        if steps not in self._second:
            self._second[steps] = run_replicate(self._runner_at(steps), reference, on_start=self.on_start, draw=1)
        second = self._second[steps]
        if second is None or second.curve is None:
            return ev
        again = evaluate(ev.label, ev.policy, ev.result, reference, thresholds=self.thresholds, replicate=second.curve)
        return _judged_twice(ev, again, second)

    def _runner_at(self, steps: int | None) -> Runner:
        """The comparison's runner, measuring ``steps`` steps."""
        return self.runner if steps == self.steps else self.runner.with_measure_steps(steps)  # type: ignore[attr-defined]

    @staticmethod
    def _bending(ev: Evaluation) -> bool:
        return ev.stable and ev.verdict is not None and bool(ev.verdict.metrics.get("bending_away"))

    def _can_grow(self, steps: int | None, last: TrialResult) -> bool:
        if steps is None or self.asked is None or not isinstance(self.runner, Extendable):
            return False
        if steps * 2 > self.asked * MAX_WINDOW_GROWTH:
            return False
        # fp32, its replicate (unless run already) and the candidate, each twice as long as the last.
        cost = 3 * 2.0 * (last.wall_s or 0.0)
        return self.deadline is None or self.clock() + cost <= self.deadline

    def _yardstick(self, steps: int) -> tuple[TrialResult, TrialCurve | None] | None:
        """fp32 and its replicate measuring ``steps`` steps, run on first use; ``None`` when
        fp32 fails there (the shorter verdict then stands)."""
        if steps not in self._at:
            runner = self.runner.with_measure_steps(steps)  # type: ignore[attr-defined]
            label = f"fp32 (reference, {steps} steps)"
            if self.on_start:
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
    """Whether ``ev`` is a stall that ``SECOND_LOOK_MULTIPLE`` times the replicate's spread
    would forgive."""
    if ev.verdict is None or ev.verdict.kind != "stalled" or ev.result.outcome != "ok":
        return False
    wider = dataclasses.replace(thresholds, spread_multiplier=thresholds.spread_multiplier * SECOND_LOOK_MULTIPLE)
    return judge(curve_of(ev.result, ev.policy.mode), curve_of(reference, "fp32"), wider, replicate=replicate).stable


def _judged_twice(first: Evaluation, again: Evaluation, second: Replicate) -> Evaluation:
    """The evaluation against the replicate whose spread allows the candidate (the second's, when
    it is stable there; the first's otherwise), its reason saying both were run."""
    if first.verdict is None or again.verdict is None:
        return first
    if again.stable:
        base, clause = again, (f"; judged against {second.label}, since against the first replicate, which strayed "
                               f"less, it was {first.verdict.kind}")
    else:
        base, clause = first, f"; {second.label} strayed no further than that allows"
    verdict = base.verdict
    assert verdict is not None  # both were checked above
    verdict = dataclasses.replace(verdict, reason=verdict.reason + clause, metrics={**verdict.metrics, "replicates": 2})
    return dataclasses.replace(base, verdict=verdict)


class Comparison(NamedTuple):
    """What ``run_comparison`` measured: the reference, each candidate, and the replicate (and
    the second one, when a narrow stall ran it)."""

    reference: Evaluation
    evaluations: list[Evaluation]
    replicate: Replicate | None
    window_note: str = ""
    measure_steps: int | None = None
    second_replicate: Replicate | None = None

    def judged_against(self) -> dict[str, TrialCurve]:
        """The replicate curve each evaluation judged stable against the second replicate was
        judged with, by label (for a picture of the limits it met)."""
        second = None if self.second_replicate is None else self.second_replicate.curve
        if second is None:
            return {}
        return {ev.label: second for ev in self.evaluations
                if ev.stable and ev.verdict is not None and ev.verdict.metrics.get("replicates") == 2}


def run_comparison(
    runner: Runner,
    candidates: list[tuple[Policy, str]],
    *,
    thresholds: StabilityThresholds | None = None,
    on_start: Callable[[int, str], None] | None = None,
    on_done: Callable[[int, Evaluation], None] | None = None,
) -> Comparison:
    """Run the fp32 reference, its perturbed replicate, then each candidate, and
    judge each against the reference, with limits widened to the replicate's spread.

    Raises:
        MpadviseError: the reference failed or is not finite (no verdict is possible).
    """
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
