"""The tune's trial book: the fp32 reference, its replicate, and every candidate run and judged.

It also re-exports the runners and evaluations under the names their callers import from here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from advisor.trial import TrialResult
from advisor.tune._judge import Evaluation, curve_of, evaluate, samples_per_step
from advisor.tune._reference import (
    Comparison,
    Replicate,
    Yardsticks,
    run_comparison,
    run_reference,
    run_replicate,
)
from advisor.tune._run import (
    WAIT_IDLE_ENV,
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
    "WAIT_IDLE_ENV", "Comparison", "Evaluation", "Extendable", "FunctionRunner", "Perturbable", "Replicate", "Runner",
    "ScriptRunner", "TrialSettings", "Trials", "Yardsticks", "curve_of", "evaluate", "prestarted_launcher",
    "run_comparison", "run_reference", "run_replicate", "samples_per_step", "wait_until_idle",
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
        return None if self.replicate is None else self.replicate.curve

    @property
    def replicate_record(self) -> dict[str, Any] | None:
        return None if self.replicate_curve is None else self.replicate.to_dict()

    def run_reference(self, *, deadline: float | None = None, clock: Callable[[], float] = time.monotonic) -> Evaluation:
        """Run fp32, the baseline every candidate is judged against (MpadviseError if it fails)."""
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
        """Run fp32 perturbed (or reuse the ``stored`` replicate); returns the reference judged with
        its spread."""
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
        policy = cand.policy(self.user_batch)
        if self.on_start:
            self.on_start(cand.label)
        return self.record(cand, policy, self.runner(policy, cand.label))

    def record(self, cand: Candidate, policy: Policy, result: TrialResult) -> Measured:
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
        """Run a candidate once more (a round of re-measurement), not recorded as its search run."""
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
    return Measured(cand, ev.goodput or 0.0, feasible=ev.result.outcome == "ok", stable=ev.stable,
                    oom=ev.result.outcome == "oom", outcome=ev.outcome, reason=ev.reason,
                    verdict_kind=ev.verdict.kind if ev.verdict else "")
