"""The tune's trial book: the fp32 reference, its replicate, and every candidate run and judged.

``Trials`` runs each trial through the run stage (``advisor.tune._run``) and judges it through
the judge stage (``advisor.tune._judge``) against the yardsticks (``advisor.tune._reference``),
keeping every evaluation for the answer. This module also re-exports the runners and
evaluations under the names their callers have long imported from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from advisor.trial import TrialResult
from advisor.tune._judge import (
    Evaluation,
    ReferenceTrialError,
    check_reference,
    curve_of,
    evaluate,
    samples_per_step,
    summed_loss_split,
)
from advisor.tune._reference import (
    MAX_WINDOW_GROWTH,
    REPLICATE_PERTURBATION,
    SECOND_LOOK_MULTIPLE,
    Comparison,
    Reference,
    Replicate,
    Yardsticks,
    run_comparison,
    run_reference,
    run_replicate,
)
from advisor.tune._run import (
    WAIT_IDLE_ENV,
    WAIT_IDLE_MAX_S,
    Extendable,
    FlopCountable,
    FunctionRunner,
    Perturbable,
    Runner,
    ScriptRunner,
    TrialSettings,
    limit_memory,
    prestarted_launcher,
    run_candidate,
    wait_until_idle,
)
from advisor.tune._space import Candidate, Measured
from advisor.tune._stability import StabilityThresholds, TrialCurve
from policies import Policy

__all__ = [
    "MAX_WINDOW_GROWTH", "REPLICATE_PERTURBATION", "SECOND_LOOK_MULTIPLE", "WAIT_IDLE_ENV", "WAIT_IDLE_MAX_S",
    "Comparison", "Evaluation", "Extendable", "FlopCountable", "FunctionRunner", "Perturbable", "Reference",
    "ReferenceTrialError", "Replicate", "Runner", "ScriptRunner", "TrialSettings", "Trials", "Yardsticks",
    "check_reference", "curve_of", "evaluate", "limit_memory", "prestarted_launcher", "run_candidate",
    "run_comparison", "run_reference", "run_replicate", "samples_per_step", "summed_loss_split", "wait_until_idle",
]


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
        """fp32 perturbed, whose spread widens the stability limits; ``None`` if none."""
        return None if self.replicate is None else self.replicate.curve

    @property
    def replicate_record(self) -> dict[str, Any] | None:
        """The usable replicate as the study keeps it, or ``None``."""
        return None if self.replicate_curve is None else self.replicate.to_dict()

    def run_reference(self, *, deadline: float | None = None, clock: Callable[[], float] = time.monotonic) -> Evaluation:
        """Run fp32, the baseline every candidate is judged against (``run_reference``).

        Raises:
            MpadviseError: the reference failed or is not finite.
        """
        # While fp32's loss still falls geometrically at the window's end, the window grows and
        # every later trial (replicate, candidates, re-measurements) measures the longer one.
        self._asked, self._deadline, self._clock = getattr(self.runner, "measure_steps", None), deadline, clock
        # The reference alone counts a step's FLOPs: every candidate runs the same arithmetic.
        counts = isinstance(self.runner, FlopCountable)
        runner = self.runner.with_flop_count(True) if counts else self.runner
        result, runner, self.window_note = run_reference(
            runner, thresholds=self.thresholds, on_start=self.on_start, deadline=deadline, clock=clock)
        self.runner = runner.with_flop_count(False) if counts else runner
        self.reference = result
        return evaluate("fp32", Policy(mode="fp32"), result, result, thresholds=self.thresholds)

    def run_replicate(self, stored: dict[str, Any] | None) -> Evaluation:
        """Run fp32 perturbed (or reuse the ``stored`` replicate when it matches), whose spread
        widens the stability limits; returns the reference judged with that spread."""
        fp32, reference = Policy(mode="fp32"), self.reference
        if reference is None:
            raise RuntimeError("run_replicate needs the reference: call run_reference first")
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
        """Run one candidate of the search and record its evaluation."""
        policy = cand.policy(self.user_batch)
        if self.on_start:
            self.on_start(cand.label)
        return self.record(cand, policy, self.runner(policy, cand.label))

    def record(self, cand: Candidate, policy: Policy, result: TrialResult) -> Measured:
        """Judge a result (the memory limit too), keep its evaluation, and report it."""
        result = limit_memory(result, self.memory_limit)
        if self.yardsticks is not None:
            ev = self.yardsticks.evaluate(cand.label, policy, result)
        else:  # the reference itself, recorded before its replicate ran
            ev = evaluate(cand.label, policy, result, self.reference, thresholds=self.thresholds,
                          replicate=self.replicate_curve)
        m = _measured(cand, ev)
        self.evaluations[cand] = ev
        if self.on_done:
            self.on_done(cand.label, ev, m)
        return m

    def run_again(self, cand: Candidate, label: str) -> Evaluation:
        """Run a candidate once more (a round of re-measurement), judged as the search judged it
        but not recorded as its search run."""
        if self.on_start:
            self.on_start(label)
        policy = cand.policy(self.user_batch)
        result = run_candidate(self.runner, policy, label, memory_limit=self.memory_limit)
        ev = evaluate(label, policy, result, self.reference, thresholds=self.thresholds, replicate=self.replicate_curve)
        if self.yardsticks is not None:
            ev = self.yardsticks.second_look(ev)
        if self.on_done:
            self.on_done(label, ev, _measured(cand, ev))
        return ev


def _measured(cand: Candidate, ev: Evaluation) -> Measured:
    """What the search learns of an evaluation."""
    return Measured(cand, ev.goodput or 0.0, feasible=ev.result.outcome == "ok", stable=ev.stable,
                    oom=ev.result.outcome == "oom", outcome=ev.outcome, reason=ev.reason,
                    verdict_kind=ev.verdict.kind if ev.verdict else "")
