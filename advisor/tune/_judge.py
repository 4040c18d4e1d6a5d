"""The judge stage: each trial's verdict, timing, goodput and speed-up against the fp32 reference."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from advisor.trial import TrialResult, json_float
from advisor.tune._stability import StabilityThresholds, TrialCurve, Verdict, judge
from advisor.tune._timing import TimingSummary, compare, goodput, summarize
from policies import Policy
from probes import MpadviseError


@dataclass(frozen=True)
class Evaluation:
    """One candidate's result, judged against the fp32 reference."""

    label: str
    policy: Policy
    result: TrialResult
    verdict: Verdict | None
    timing: TimingSummary | None
    goodput: float | None
    speedup: float | None
    speed_verdict: str | None  # faster / slower / tie, against fp32
    final_loss_gap: float | None

    @property
    def stable(self) -> bool:
        return self.result.outcome == "ok" and self.verdict is not None and self.verdict.stable

    @property
    def outcome(self) -> str:
        if self.result.outcome != "ok":
            return self.result.outcome
        if self.verdict is not None and self.verdict.kind == "too_short":
            return "too-short"  # not judged: neither stable nor shown to be unstable
        return "ok" if self.verdict is None or self.verdict.stable else "unstable"

    @property
    def reason(self) -> str:
        if self.result.outcome != "ok":
            return self.result.reason
        return "" if self.verdict is None else self.verdict.reason

    def to_dict(self) -> dict[str, Any]:
        r = self.result
        return {
            "label": self.label, "mode": self.policy.mode, "policy": self.policy.to_dict(), "outcome": self.outcome,
            "stable": self.stable, "reason": self.reason,
            "verdict": None if self.verdict is None else self.verdict.to_dict(), "goodput": self.goodput,
            "speedup_vs_fp32": self.speedup, "speed_vs_fp32": self.speed_verdict,
            "final_loss_gap": self.final_loss_gap,
            "step_time": None if self.timing is None else self.timing.to_dict(), "peak_memory": r.peak_memory,
            "memory_kind": r.memory_kind, "skipped_steps": sum(1 for s in r.skipped if s), "steps": len(r.losses),
            "micro_batch": r.micro_batch, "grad_accum_steps": r.grad_accum_steps, "global_batch": r.global_batch,
            "user_batch": r.user_batch, "notes": list(r.notes), "ranks": r.ranks, "threads": r.threads,
            "fsdp": r.fsdp, "exit_code": r.exit_code,
            "stderr_tail": r.stderr_tail if self.result.outcome != "ok" else "", "wall_s": r.wall_s,
            "phases": r.phases, "losses": [json_float(v) for v in r.losses], "step_times": list(r.step_times),
        }


def curve_of(result: TrialResult, mode: str) -> TrialCurve:
    return TrialCurve(
        mode=mode, losses=result.losses, skipped=result.skipped,
        loss_scale=result.loss_scale if any(v is not None for v in result.loss_scale) else (),
        underflow=result.underflow if any(v is not None for v in result.underflow) else (),
        optimizer_eps=result.optimizer_eps,
    )


def samples_per_step(result: TrialResult) -> int | None:
    """Samples one optimizer step consumed (median over steps), or the reported global batch."""
    counted = [s for s in result.samples or () if s]
    return statistics.median_high(counted) if counted else result.global_batch


def evaluate(
    label: str, policy: Policy, result: TrialResult, reference: TrialResult | None, *,
    thresholds: StabilityThresholds | None = None, replicate: TrialCurve | None = None,
) -> Evaluation:
    """Judge one result against the reference, the limits widened to ``replicate``'s spread."""
    thresholds = thresholds or StabilityThresholds()
    summed = None if reference is None else summed_loss_split(result, reference)
    if summed is not None:
        result = result.with_outcome("unsupported", summed)
    if result.outcome != "ok" or not result.step_times:
        if result.outcome == "ok":  # ran, but the script ended before one full step was timed
            result = result.with_outcome("no-step", "the script ended before a step could be timed")
        return Evaluation(label, policy, result, None, None, None, None, None, None)
    timing = summarize(result.step_times, warmup_of(result))
    good = _goodput(result, thresholds)
    verdict = speedup = speed_verdict = gap = None
    if reference is not None and reference.outcome == "ok" and reference.step_times:
        verdict = judge(curve_of(result, policy.mode), curve_of(reference, "fp32"), thresholds,
                        replicate=replicate)
        gap = verdict.metrics.get("final_gap")
        comparison = compare(timing, summarize(reference.step_times, warmup_of(reference)))
        ref_good = _goodput(reference, thresholds)
        # Goodput counts samples, so a candidate with another micro-batch compares fairly;
        # without sample counts, fall back to the step-time ratio.
        speedup = good / ref_good if good is not None and ref_good else comparison.ratio
        speed_verdict = comparison.verdict
    return Evaluation(label, policy, result, verdict, timing, good, speedup, speed_verdict, gap)


def summed_loss_split(result: TrialResult, reference: TrialResult) -> str | None:
    """Why a split candidate cannot keep the script's optimisation, its loss summed over the batch:
    ``step()`` divides each micro-batch's loss by the accumulation count, so a summed loss's
    gradient shrinks by that count, which the first step shows against fp32's."""
    accum = result.grad_accum_steps or 1
    if accum < 2 or (reference.grad_accum_steps or 1) != 1 or not result.losses or not reference.losses:
        return None
    first, ref_first = result.losses[0], reference.losses[0]
    if not (math.isfinite(first) and math.isfinite(ref_first) and first > 0 and ref_first > 0):
        return None
    ratio = ref_first / first
    if abs(ratio / accum - 1.0) > 0.2:
        return None
    return (f"the script's loss is summed over the batch, not averaged: split into {accum} micro-batches its first "
            f"loss is {first:.4g} against fp32's {ref_first:.4g} on the whole batch ({ratio:.1f}x), so accumulating "
            f"would shrink the gradient {accum}x; use reduction='mean' to let a tune split the batch")


def warmup_of(result: TrialResult) -> int:  # leaves a short run at least one timed step
    return min(result.warmup_steps, max(0, len(result.step_times) - 1))


def _goodput(result: TrialResult, thresholds: StabilityThresholds) -> float | None:
    samples = samples_per_step(result)
    if not samples:
        return None
    return goodput(samples, result.step_times, result.skipped, warmup_of(result), calibration_steps=thresholds.calibration_steps)


class ReferenceTrialError(MpadviseError):
    """The fp32 reference did not give a usable baseline: no comparison is possible."""


def check_reference(result: TrialResult) -> None:
    if result.outcome != "ok":
        raise ReferenceTrialError(f"the fp32 reference trial failed ({result.outcome}): {result.reason}")
    bad = next((i for i, v in enumerate(result.losses) if not math.isfinite(v)), None)
    if bad is not None:
        raise ReferenceTrialError(
            f"no verdict is possible: the fp32 reference itself is not finite (loss {result.losses[bad]} "
            f"at step {bad}); lower the learning rate or fix the script, then try again"
        )
    if not result.step_times:
        raise ReferenceTrialError("the fp32 reference ended before one step could be timed; let the script run longer")
