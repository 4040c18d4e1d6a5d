"""The data of a stability verdict: the curves a trial records, the limits, and the verdict.

Plain frozen dataclasses that validate their fields and name the one that is wrong; no torch, no
files, no clocks. ``_verdict_rules`` decides on them and ``_stability.judge`` is the entry point.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

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
        underflow: per step, the fraction of sampled gradient values lost to fp16 underflow:
            already flushed to zero by an fp16 backward, or nonzero with a scaled magnitude
            ``|g| * loss_scale`` below fp16's smallest subnormal value (2**-24), which it would flush:
            an fp16 backward flushes them to zero. ``None`` where not measured (modes other
            than fp16). Empty when not recorded at all.
        lr: the learning rate of the trial, when known (only reported, never judged).
        optimizer_eps: the smallest eps of the trial's optimizer, when known: the advice after
            a failure may depend on it (pure fp16 rounds eps=1e-8 to zero).
    """

    mode: str
    losses: tuple[float, ...]
    skipped: tuple[bool, ...] = ()
    loss_scale: tuple[float | None, ...] = ()
    underflow: tuple[float | None, ...] = ()
    lr: float | None = None
    optimizer_eps: float | None = None

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
            fp32's final loss (so a loss floor above a loss heading towards zero is caught). 5%
            is nearly three times the seed spread of 1.8%.
        climb_margin: divergence limit for a finite curve; the candidate's smoothed loss ending
            more than this fraction above where it started, while fp32's did not, is a
            divergence. 5% is well outside seed noise.
        min_reference_drop: when fp32's smoothed loss falls by less than this fraction of its
            start, the ratio of two decreases that are both within noise means nothing, so
            progress is not judged; only the final gap is. 2% is just above the 1.8% seed
            spread.
        spread_multiplier: with a replicate (fp32 again, its initial parameters perturbed by
            one bf16 rounding), how many times the replicate's drift a candidate's progress
            shortfall and final gap may reach; the two limits above stay floors. A candidate
            rounds at every step where the replicate rounded once, and one replicate is one
            draw, so 2 rather than 1; 0 ignores the replicate.
        max_spread_final_gap: the most a replicate's drift may widen the final-gap limit to
            (1.0: twice fp32's final loss). A candidate ending further above fp32 than that is
            never stable: where one rounding moves fp32's final loss that far, the final level
            cannot vouch for a candidate, and a loss floor must not hide in it.
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
    spread_multiplier: float = 2.0
    max_spread_final_gap: float = 1.0

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
        for name in ("min_loss_scale", "min_progress_ratio", "max_final_gap", "climb_margin",
                     "spread_multiplier", "max_spread_final_gap"):
            _check_number(name, getattr(self, name), low=0.0, high=None)

    def smoothing_window(self, steps: int) -> int:
        """The smoothing window, in steps, for ``steps`` compared steps."""
        return min(max(self.min_smoothing_steps, round(steps * self.smoothing_fraction)), max(1, steps // 2))

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
            (True when fp32's loss did not fall, or fell within its own spread, so progress was
            not judged), ``progress_ratio``, ``final_gap``; with a replicate also the spread
            and the limits it set: ``replicate_end``, ``progress_spread``, ``final_spread``,
            ``progress_limit``, ``final_gap_limit``.
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


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"StabilityThresholds.{name} must be an integer >= {minimum}, got {value!r}")


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
