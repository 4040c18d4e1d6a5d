"""Stability verdicts: is a candidate's loss curve as good as the fp32 reference's?

Pure functions over recorded trial data: no torch, no files, no clocks. A trial records one
``TrialCurve`` per precision mode, all with the same seed and data order, so the candidate
and the fp32 reference can be compared step by step. ``judge`` turns the pair into a
``Verdict`` whose reason says, with numbers, what went wrong and what to do.

The defaults of ``StabilityThresholds`` and the evidence for them are in docs/stability.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# Lower rank = safer. Within the speed noise band the search prefers the safer policy:
# full precision first; then mixed modes, which keep fp32 master weights (bf16 before fp16,
# since bf16 has fp32's exponent range and needs no loss scaling); then FP8, which also keeps
# high-precision weights but computes matmuls with 3 mantissa bits (torchao's default dynamic
# per-tensor scaling before Transformer Engine's delayed scaling, whose amax history can go
# stale after a spike); then pure low-precision modes, which lose small updates
# (bf16 before fp16: fp16 also overflows without a scaler).
SAFETY_ORDER: tuple[str, ...] = (
    "fp32",
    "tf32",
    "bf16-mixed",
    "fp16-mixed",
    "fp8-torchao",
    "fp8-te",
    "bf16-true",
    "fp16-true",
)

VERDICT_KINDS: tuple[str, ...] = (
    "ok",
    "diverged",
    "stalled",
    "skips",
    "scale_collapse",
    "underflow",
    "reference_not_finite",
    "too_short",
)

# Below this, a loss level is treated as zero when it divides (avoids dividing by 0.0).
_TINY = 1e-12


def safety_rank(mode: str) -> int:
    """How safe a precision mode is numerically; lower is safer.

    Args:
        mode: a mode name from ``SAFETY_ORDER`` (``"fp32"``, ``"bf16-mixed"``, ...).

    Returns:
        The mode's index in ``SAFETY_ORDER`` (0 for fp32).

    Raises:
        ValueError: the mode is not ranked; a new mode must be placed in ``SAFETY_ORDER``.
    """
    try:
        return SAFETY_ORDER.index(mode)
    except ValueError:
        raise ValueError(
            f"mode {mode!r} has no safety rank; expected one of {', '.join(SAFETY_ORDER)} "
            "(a new mode must be added to advisor._stability.SAFETY_ORDER)"
        ) from None


@dataclass(frozen=True)
class TrialCurve:
    """What one trial recorded per optimizer step, for one precision mode.

    Attributes:
        mode: the precision mode that produced the curve (``"fp32"``, ``"fp16-mixed"``, ...).
        losses: the loss of every optimizer step, in order; may contain NaN or inf.
        skipped: per step, whether the GradScaler skipped the optimizer step because the
            gradients overflowed. Empty when no scaler was used (no step skipped).
        loss_scale: per step, the GradScaler's scale, ``None`` where no scaler ran. Empty when
            not recorded at all.
        underflow: per step, the fraction of sampled nonzero gradient values whose scaled
            magnitude ``|g| * loss_scale`` is below fp16's smallest normal value (2**-14):
            they are subnormal in the fp16 backward, have lost precision, and the next
            backoff flushes them to zero (below 2**-24). ``None`` where not measured (modes
            other than fp16). Empty when not recorded at all.
        lr: the learning rate of the trial, when known (only reported, never judged).
    """

    mode: str
    losses: tuple[float, ...]
    skipped: tuple[bool, ...] = ()
    loss_scale: tuple[float | None, ...] = ()
    underflow: tuple[float | None, ...] = ()
    lr: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.mode, str) or not self.mode:
            raise ValueError(f"TrialCurve.mode must be a non-empty string, got {self.mode!r}")
        # Accept any sequence (lists from JSON), store tuples so the curve stays hashable.
        losses = tuple(_as_float("losses", i, v) for i, v in enumerate(self.losses))
        object.__setattr__(self, "losses", losses)
        n = len(losses)
        skipped = tuple(self.skipped)
        for i, s in enumerate(skipped):
            if not isinstance(s, bool):
                raise ValueError(f"TrialCurve.skipped[{i}] must be a bool, got {s!r}")
        scales = tuple(
            None if v is None else _as_float("loss_scale", i, v)
            for i, v in enumerate(self.loss_scale)
        )
        for i, v in enumerate(scales):
            if v is not None and not v >= 0.0:
                raise ValueError(f"TrialCurve.loss_scale[{i}] must be >= 0 or None, got {v!r}")
        underflow = tuple(
            None if v is None else _as_float("underflow", i, v)
            for i, v in enumerate(self.underflow)
        )
        for i, v in enumerate(underflow):
            if v is not None and not 0.0 <= v <= 1.0:
                raise ValueError(
                    f"TrialCurve.underflow[{i}] must be a fraction in [0, 1] or None, got {v!r}"
                )
        for name, values in (
            ("skipped", skipped),
            ("loss_scale", scales),
            ("underflow", underflow),
        ):
            if values and len(values) != n:
                raise ValueError(
                    f"TrialCurve.{name} has {len(values)} entries but losses has {n}; "
                    "record one per optimizer step, or leave it empty when not recorded"
                )
        object.__setattr__(self, "skipped", skipped)
        object.__setattr__(self, "loss_scale", scales)
        object.__setattr__(self, "underflow", underflow)
        if self.lr is not None:
            object.__setattr__(self, "lr", _as_float("lr", None, self.lr))

    def __len__(self) -> int:
        return len(self.losses)

    def was_skipped(self, step: int) -> bool:
        """Whether the scaler skipped ``step`` (False when skips were not recorded)."""
        return bool(self.skipped) and self.skipped[step]

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-ready dict: non-finite losses become ``"nan"``, ``"inf"``, ``"-inf"``.

        Returns:
            Plain lists, strings, numbers and ``None``; ``from_dict`` reads it back.
        """
        return {
            "mode": self.mode,
            "losses": [_encode_float(v) for v in self.losses],
            "skipped": list(self.skipped),
            "loss_scale": [None if v is None else _encode_float(v) for v in self.loss_scale],
            "underflow": list(self.underflow),
            "lr": self.lr,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TrialCurve:
        """Inverse of ``to_dict``; unknown keys are ignored so that newer files still load.

        Args:
            data: a mapping as written by ``to_dict``.

        Returns:
            The curve.
        """
        if "mode" not in data or "losses" not in data:
            raise ValueError("TrialCurve data needs 'mode' and 'losses'")
        return cls(
            mode=data["mode"],
            losses=tuple(data["losses"]),
            skipped=tuple(data.get("skipped") or ()),
            loss_scale=tuple(data.get("loss_scale") or ()),
            underflow=tuple(data.get("underflow") or ()),
            lr=data.get("lr"),
        )


@dataclass(frozen=True)
class StabilityThresholds:
    """The limits ``judge`` applies; each default is justified in docs/stability.md.

    Attributes:
        min_steps: fewer compared steps than this gives a ``too_short`` verdict. 32 is twice
            the calibration window: as many judged steps as calibration steps.
        calibration_steps: skips in the first steps are ignored. GradScaler starts at 2**16
            and halves on every overflow, so 16 consecutive skips bring it down to 1, the
            lowest healthy scale; any healthy scale is found within 16 steps.
        max_skip_fraction: most skipped steps allowed after calibration, as a fraction of
            those steps (one skip is always allowed). A healthy dynamic scaler skips about one
            step per growth_interval (2000 by default), i.e. 0.05%; 5% leaves room for a
            growth_interval as short as 20 while catching persistent overflow.
        min_loss_scale: a loss scale below this is a collapse. A healthy GradScaler never
            goes below 1: below 1 the gradients overflow fp16 even unscaled.
        max_underflow_fraction: most gradient values allowed to flush to zero in fp16, as
            the mean over the measured steps after calibration. Micikevicius et al. (2018)
            found about 5% of weight gradients below 2**-24 with no scaling at all, the very
            loss that scaling exists to prevent; with a scaler in place, more than that means
            the scale is too small.
        smoothing_fraction: the smoothing window, as a fraction of the compared steps; loss
            levels are medians over a window, robust to the odd spiky batch.
        min_smoothing_steps: the smoothing window is at least this many steps.
        min_progress_ratio: stall limit; the candidate's smoothed loss decrease must be at
            least this fraction of fp32's. The seed-to-seed spread of final BERT loss is about
            1.8% and the TF32-vs-AMP gap 0.2% (NVIDIA DeepLearningExamples); a short trial is
            noisier, so the band is 10%.
        max_final_gap: most the candidate's smoothed final loss may exceed fp32's, relative to
            fp32's final loss (or to how far fp32's loss fell, whichever is larger). 5% is
            nearly three times the seed spread of 1.8%.
        climb_margin: divergence limit for a finite curve; the candidate's smoothed loss ending
            more than this fraction above where it started, while fp32's did not, is a
            divergence. 5% is well outside seed noise.
        min_reference_drop: when fp32's smoothed loss falls by less than this fraction of its
            start, the ratio of two decreases that are both within noise means nothing, so
            progress is not judged; only the final gap is. 2% is just above the 1.8% seed
            spread.
    """

    min_steps: int = 32
    calibration_steps: int = 16
    max_skip_fraction: float = 0.05
    min_loss_scale: float = 1.0
    max_underflow_fraction: float = 0.05
    smoothing_fraction: float = 0.1
    min_smoothing_steps: int = 5
    min_progress_ratio: float = 0.9
    max_final_gap: float = 0.05
    climb_margin: float = 0.05
    min_reference_drop: float = 0.02

    def __post_init__(self) -> None:
        for name in ("min_steps", "min_smoothing_steps"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("calibration_steps", self.calibration_steps, minimum=0)
        for name in ("max_skip_fraction", "max_underflow_fraction", "min_reference_drop"):
            _check_number(name, getattr(self, name), low=0.0, high=1.0)
        _check_number("smoothing_fraction", self.smoothing_fraction, low=0.0, high=0.5)
        if self.smoothing_fraction == 0.0:
            raise ValueError(
                "StabilityThresholds.smoothing_fraction must be > 0 (a fraction of the steps), "
                "got 0.0"
            )
        for name in ("min_loss_scale", "min_progress_ratio", "max_final_gap", "climb_margin"):
            _check_number(name, getattr(self, name), low=0.0, high=None)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of every threshold."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StabilityThresholds:
        """Inverse of ``to_dict``; missing keys take their defaults, unknown keys are ignored."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Verdict:
    """The judgement of one candidate curve against the fp32 reference.

    Attributes:
        stable: whether the candidate may be recommended.
        kind: one of ``VERDICT_KINDS``.
        reason: one or two sentences for the user, with the numbers and what to do.
        metrics: plain numbers behind the verdict; keys present only where computed:
            ``steps`` (compared steps), ``first_nonfinite_step`` (1-based),
            ``reference_first_nonfinite_step``, ``skips_after_calibration``,
            ``skip_fraction``, ``min_scale``, ``mean_underflow``, ``max_underflow``,
            ``smoothing_window``, ``candidate_start``, ``candidate_end``,
            ``reference_start``, ``reference_end``, ``reference_drop`` (fraction of its
            start), ``candidate_rise`` (fraction of its start), ``reference_flat``
            (True when fp32's loss did not fall, so progress was not judged),
            ``progress_ratio``, ``final_gap``.
    """

    stable: bool
    kind: str
    reason: str
    metrics: Mapping[str, float | int | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in VERDICT_KINDS:
            raise ValueError(
                f"Verdict.kind must be one of {', '.join(VERDICT_KINDS)}, got {self.kind!r}"
            )
        if self.stable != (self.kind == "ok"):
            raise ValueError(
                f"Verdict.stable must be True exactly when kind is 'ok'; got stable={self.stable} "
                f"with kind={self.kind!r}"
            )
        object.__setattr__(self, "metrics", dict(self.metrics))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict; non-finite metric values become strings like ``"nan"``."""
        return {
            "stable": self.stable,
            "kind": self.kind,
            "reason": self.reason,
            "metrics": {
                k: v if isinstance(v, bool | int) else _encode_float(v)
                for k, v in self.metrics.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Verdict:
        """Inverse of ``to_dict``."""
        metrics = {
            k: float(v) if isinstance(v, str) else v for k, v in (data.get("metrics") or {}).items()
        }
        return cls(
            stable=bool(data["stable"]),
            kind=data["kind"],
            reason=data["reason"],
            metrics=metrics,
        )


def smooth(losses: Sequence[float], window: int) -> tuple[float, ...]:
    """Trailing moving median of a loss curve, leaving out non-finite values.

    Args:
        losses: one loss per step.
        window: how many steps each median covers (the step itself and the ones before it).

    Returns:
        One value per step: the median of the finite losses among the last ``window`` steps,
        NaN where there are none.
    """
    _check_int("window", window, minimum=1, owner="smooth")
    out = []
    for i in range(len(losses)):
        out.append(_median_finite(losses[max(0, i + 1 - window) : i + 1]))
    return tuple(out)


def judge(
    candidate: TrialCurve,
    reference: TrialCurve,
    thresholds: StabilityThresholds | None = None,
) -> Verdict:
    """Decide whether a candidate's trial curve is as stable as the fp32 reference's.

    Both curves come from the same seed and data order and are compared step by step over
    their common length. The checks run in order, and the first that fails gives the verdict:
    a non-finite reference (no verdict possible), a non-finite candidate loss on a step the
    optimizer applied (diverged), too few steps, loss-scale collapse, persistent skips,
    gradient underflow, a climbing loss (diverged), too little progress (stalled) and too
    large a final gap (stalled). Non-finite losses on steps the GradScaler skipped are the
    scaler doing its job: they count as skips, not divergence.

    Args:
        candidate: the curve of the precision mode under test.
        reference: the fp32 curve of the same trial.
        thresholds: the limits; the defaults when ``None``.

    Returns:
        The verdict, with a reason in words and the numbers behind it.
    """
    t = StabilityThresholds() if thresholds is None else thresholds
    name = _label(candidate.mode)
    ref_name = reference.mode

    bad = _first_nonfinite(reference.losses, lambda i: False)
    if bad is not None:
        return Verdict(
            False,
            "reference_not_finite",
            f"no verdict possible: the {ref_name} reference itself reached a "
            f"{_describe(reference.losses[bad])} loss at step {bad + 1} of {len(reference)}, "
            "so the script diverges even in full precision; lower the learning rate or fix the "
            "script (a log or division by zero, say) before tuning",
            {"reference_first_nonfinite_step": bad + 1, "steps": len(reference)},
        )

    bad = _first_nonfinite(candidate.losses, candidate.was_skipped)
    if bad is not None:
        applied = " on a step the optimizer applied" if any(candidate.skipped) else ""
        return Verdict(
            False,
            "diverged",
            f"{name} diverged: loss became {_describe(candidate.losses[bad])} at step {bad + 1} "
            f"of {len(candidate)}{applied}; {_advice(candidate.mode, 'diverged')}",
            {"first_nonfinite_step": bad + 1, "steps": len(candidate)},
        )

    n = min(len(candidate), len(reference))
    if n < t.min_steps:
        return Verdict(
            False,
            "too_short",
            f"too few steps to judge {name}: {n} steps compared, need at least {t.min_steps}; "
            "run the trial longer (a few hundred optimizer steps give a clear verdict)",
            {"steps": n},
        )

    window = min(max(t.min_smoothing_steps, round(n * t.smoothing_fraction)), max(1, n // 2))
    metrics: dict[str, float | int | bool] = {"steps": n, "smoothing_window": window}
    cand_losses = candidate.losses[:n]
    tail_bad = _nonfinite_tail(cand_losses, window)
    if tail_bad is not None:
        metrics["first_nonfinite_step"] = tail_bad + 1
        return Verdict(
            False,
            "diverged",
            f"{name} diverged: loss stayed {_describe(cand_losses[-1])} from step {tail_bad + 1} "
            f"to the end ({n} steps), every one skipped by the scaler; "
            f"{_advice(candidate.mode, 'diverged')}",
            metrics,
        )

    # Loss scaler: collapse, then persistent skips, then underflow.
    cal = min(t.calibration_steps, n)
    scales = [s for s in candidate.loss_scale[:n] if s is not None]
    if scales:
        metrics["min_scale"] = min(scales)
    skips = sum(candidate.was_skipped(i) for i in range(cal, n))
    judged_steps = n - cal
    skip_fraction = skips / judged_steps if judged_steps else 0.0
    metrics["skips_after_calibration"] = skips
    metrics["skip_fraction"] = skip_fraction
    under_all = [u for u in candidate.underflow[:n] if u is not None]
    under = [u for u in candidate.underflow[cal:n] if u is not None] or under_all
    if under:
        metrics["mean_underflow"] = sum(under) / len(under)
        metrics["max_underflow"] = max(under)

    if scales and min(scales) < t.min_loss_scale:
        low = min(scales)
        return Verdict(
            False,
            "scale_collapse",
            f"{name}'s loss scale collapsed to {_format_scale(low)}, below the limit of "
            f"{_format_scale(t.min_loss_scale)}, with {skips} of {judged_steps} steps skipped "
            f"after the first {cal}: gradients overflow fp16 even unscaled; "
            f"{_advice(candidate.mode, 'scale_collapse')}",
            metrics,
        )
    if skips > 1 and skip_fraction > t.max_skip_fraction:
        scale_note = f"; the loss scale fell to {_format_scale(min(scales))}" if scales else ""
        return Verdict(
            False,
            "skips",
            f"{name} skipped {_pct(skip_fraction)} of steps after the first {cal} "
            f"({skips} of {judged_steps}; limit {_pct(t.max_skip_fraction)}{scale_note}): "
            f"{_advice(candidate.mode, 'skips')}",
            metrics,
        )
    if under and metrics["mean_underflow"] > t.max_underflow_fraction:
        scale_note = f" (lowest loss scale {_format_scale(min(scales))})" if scales else ""
        return Verdict(
            False,
            "underflow",
            f"{name} loses gradients to underflow: on average {_pct(metrics['mean_underflow'])} "
            f"of sampled gradient values (up to {_pct(metrics['max_underflow'])} on one step) "
            f"fall below fp16's normal range (2^-14) once scaled, where they lose precision and "
            f"the next backoff flushes them to zero, limit "
            f"{_pct(t.max_underflow_fraction)}{scale_note}; {_advice(candidate.mode, 'underflow')}",
            metrics,
        )

    # Loss curves, smoothed: levels are medians over the first and last windows.
    c_start, c_end = _levels(cand_losses, window)
    r_start, r_end = _levels(reference.losses[:n], window)
    r_drop = r_start - r_end
    c_rise = c_end - c_start
    ref_drop_rel = r_drop / max(abs(r_start), _TINY)
    cand_rise_rel = c_rise / max(abs(c_start), _TINY)
    ref_rise_rel = -ref_drop_rel
    metrics.update(
        candidate_start=c_start,
        candidate_end=c_end,
        reference_start=r_start,
        reference_end=r_end,
        reference_drop=ref_drop_rel,
        candidate_rise=cand_rise_rel,
    )
    ref_curve = f"{ref_name}'s {_fmt(r_start)} -> {_fmt(r_end)}"

    if cand_rise_rel > t.climb_margin and ref_rise_rel <= t.climb_margin:
        return Verdict(
            False,
            "diverged",
            f"{name} diverged: its smoothed loss rose {_fmt(c_start)} -> {_fmt(c_end)} "
            f"(+{_pct(cand_rise_rel)}, limit +{_pct(t.climb_margin)}) over {n} steps against "
            f"{ref_curve}; {_advice(candidate.mode, 'climbed')}",
            metrics,
        )

    # A reference that did not fall (or rose) gives no decrease to compare against.
    reference_flat = r_drop <= 0 or ref_drop_rel < t.min_reference_drop
    metrics["reference_flat"] = reference_flat
    if not reference_flat:
        progress = (c_start - c_end) / r_drop
        metrics["progress_ratio"] = progress
        if progress < t.min_progress_ratio:
            if progress <= 0:
                how = f"its smoothed loss did not fall ({_fmt(c_start)} -> {_fmt(c_end)})"
            else:
                how = (
                    f"its smoothed loss fell {_pct(progress)} as far as {ref_name}'s "
                    f"({_fmt(c_start)} -> {_fmt(c_end)})"
                )
            return Verdict(
                False,
                "stalled",
                f"{name} stalled: {how} against {ref_curve} over {n} steps "
                f"(limit {_pct(t.min_progress_ratio)}); {_advice(candidate.mode, 'stalled')}",
                metrics,
            )

    # Relative to fp32's final loss, or to how far it fell when that is larger, so a loss
    # that converges towards zero does not turn a tiny absolute gap into a huge ratio.
    gap = (c_end - r_end) / max(abs(r_end), r_drop, _TINY)
    metrics["final_gap"] = gap
    flat_note = (
        f"{ref_name}'s loss did not fall ({_fmt(r_start)} -> {_fmt(r_end)}), so progress "
        "cannot be compared and only the final loss is judged; "
        if reference_flat
        else ""
    )
    if gap > t.max_final_gap:
        return Verdict(
            False,
            "stalled",
            f"{name} fell behind {ref_name}: {flat_note}its smoothed final loss is "
            f"{_fmt(c_end)} against {_fmt(r_end)} after {n} steps ({_pct(gap)} higher, limit "
            f"{_pct(t.max_final_gap)}); {_advice(candidate.mode, 'stalled')}",
            metrics,
        )

    final = (
        f"final loss {_pct(abs(gap))} {'higher' if gap > 0 else 'lower'} than {ref_name}'s "
        f"(limit {_pct(t.max_final_gap)} higher)"
    )
    if reference_flat:
        pace = f"{flat_note}{final}"
    else:
        pace = (
            f"its loss fell {_pct(metrics['progress_ratio'])} as far as {ref_name}'s "
            f"(limit {_pct(t.min_progress_ratio)}), {final}"
        )
    scaler_note = (
        f", {skips} skipped step{'s' if skips != 1 else ''} after the first {cal}"
        if candidate.skipped
        else ""
    )
    return Verdict(
        True,
        "ok",
        f"{name} is stable over {n} steps: {pace}{scaler_note}",
        metrics,
    )


def _advice(mode: str, kind: str) -> str:
    """What to try instead, in the user's terms, for a failure ``kind`` of ``mode``.

    ``kind`` is a verdict kind, or ``"climbed"`` for a finite loss that rose (a divergence
    that is not an overflow).
    """
    if mode.startswith("fp8"):
        return (
            "FP8 matmuls (e4m3 keeps 3 mantissa bits) are too coarse for this model; use "
            "bf16-mixed, or keep the sensitive layers (first, last, small ones) out of FP8"
        )
    if mode == "bf16-true":
        if kind == "stalled":
            return (
                "updates smaller than bf16's precision (8 significant bits, about 0.4% of a "
                "weight) are lost; use bf16-mixed, which keeps fp32 master weights"
            )
        return "use bf16-mixed, which keeps fp32 master weights and optimizer state"
    if mode == "fp16-true":
        if kind == "diverged":
            return "fp16 overflows without loss scaling; use fp16-mixed (GradScaler) or bf16-mixed"
        return "use fp16-mixed (GradScaler, fp32 master weights) or bf16-mixed"
    if mode == "fp16-mixed":
        return {
            "diverged": "activations overflow fp16 even with loss scaling; use bf16-mixed where "
            "the hardware has bf16, or keep the overflowing layers in fp32",
            "climbed": "use bf16-mixed where the hardware has bf16, or keep the sensitive layers "
            "in fp32",
            "scale_collapse": "use bf16-mixed where the hardware has bf16 (fp32's exponent "
            "range, no loss scaling needed)",
            "skips": "gradients overflow fp16 even at small scales; use bf16-mixed where the "
            "hardware has bf16, or a longer growth_interval if the scale keeps growing into "
            "overflow",
            "underflow": "the loss scale is too small; raise the initial scale or use a static "
            "loss scale, or use bf16-mixed where the hardware has bf16",
            "stalled": "use bf16-mixed where the hardware has bf16, or a larger loss scale if "
            "small gradients flush to zero",
        }.get(kind, "use bf16-mixed where the hardware has bf16")
    if mode == "bf16-mixed":
        return (
            "bf16-mixed keeps fp32 weights, so an operation computed in bf16 is to blame; use "
            "tf32 or fp32, or keep that operation in fp32"
        )
    if mode == "tf32":
        return "use fp32"
    return "use fp32 or bf16-mixed"


def _label(mode: str) -> str:
    """The mode as named in reasons; pure modes say so, since that is what goes wrong."""
    if mode == "bf16-true":
        return "bf16-true (pure bf16)"
    if mode == "fp16-true":
        return "fp16-true (pure fp16)"
    return mode


def _first_nonfinite(losses: Sequence[float], skipped: Any) -> int | None:
    """Index of the first non-finite loss on a step that was not skipped, or None."""
    for i, v in enumerate(losses):
        if not math.isfinite(v) and not skipped(i):
            return i
    return None


def _nonfinite_tail(losses: Sequence[float], window: int) -> int | None:
    """Start of a trailing run of non-finite losses at least ``window`` long, or None."""
    start = len(losses)
    while start > 0 and not math.isfinite(losses[start - 1]):
        start -= 1
    return start if len(losses) - start >= window else None


def _levels(losses: Sequence[float], window: int) -> tuple[float, float]:
    """Smoothed start and end levels: medians of the finite losses of the first/last windows."""
    finite = [v for v in losses if math.isfinite(v)]
    return _median_finite(finite[:window]), _median_finite(finite[-window:])


def _median_finite(values: Sequence[float]) -> float:
    finite = sorted(v for v in values if math.isfinite(v))
    if not finite:
        return math.nan
    mid = len(finite) // 2
    return finite[mid] if len(finite) % 2 else (finite[mid - 1] + finite[mid]) / 2.0


def _describe(value: float) -> str:
    return "NaN" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _pct(fraction: float) -> str:
    return f"{fraction:.0%}" if abs(fraction) >= 0.1 else f"{fraction:.1%}"


def _format_scale(scale: float) -> str:
    """A loss scale for people: ``65536``, ``0.0039 (2^-8)``."""
    if scale > 0:
        exponent = math.log2(scale)
        if exponent == int(exponent) and scale < 1:
            return f"{scale:.2g} (2^{int(exponent)})"
    return f"{scale:.0f}" if scale >= 1 else f"{scale:.2g}"


def _encode_float(value: float) -> float | str:
    """Finite floats as they are; NaN and infinities as strings that strict JSON accepts."""
    if math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _as_float(name: str, index: int | None, value: Any) -> float:
    where = f"TrialCurve.{name}" + ("" if index is None else f"[{index}]")
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a number, got {value!r}") from None


def _check_int(name: str, value: Any, *, minimum: int, owner: str = "StabilityThresholds") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an integer >= {minimum}, got {value!r}")


def _check_number(name: str, value: Any, *, low: float, high: float | None) -> None:
    ok = (
        not isinstance(value, bool)
        and isinstance(value, int | float)
        and math.isfinite(value)
        and value >= low
        and (high is None or value <= high)
    )
    if not ok:
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"StabilityThresholds.{name} must be a number {bound}, got {value!r}")
