"""The data of a stability verdict: the curves a trial records, the limits, and the verdict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

VERDICT_KINDS: tuple[str, ...] = (
    "ok", "diverged", "stalled", "skips", "scale_collapse", "underflow", "reference_not_finite", "too_short",
)


@dataclass(frozen=True)
class TrialCurve:
    """What one trial recorded per optimizer step, for one precision mode.

    ``skipped``, ``loss_scale`` and ``underflow`` are empty when not recorded. ``underflow`` is the
    fraction of sampled gradient values an fp16 backward flushes to zero (scaled magnitude below
    2**-24). ``optimizer_eps`` matters to the advice after a failure (pure fp16 rounds 1e-8 to 0).
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
        return bool(self.skipped) and self.skipped[step]


@dataclass(frozen=True)
class StabilityThresholds:
    """The limits ``judge`` applies; each default is justified in docs/stability.md.

    ``calibration_steps``: skips in the first steps are ignored (GradScaler starts at 2**16 and
    halves on every overflow). ``max_final_gap`` is relative to fp32's final loss.
    ``min_reference_drop``: when fp32 falls by less, progress is not judged, only the final gap.
    ``spread_multiplier``: how many times a replicate's drift the progress shortfall and final
    gap may reach (the fixed limits stay floors; 0 ignores the replicate), the final-gap limit
    widening to at most ``max_spread_final_gap``.
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



@dataclass(frozen=True)
class Verdict:
    """The judgement of one candidate curve against the fp32 reference: ``kind`` is one of
    ``VERDICT_KINDS``, ``reason`` is for the user, ``metrics`` the numbers behind it."""

    stable: bool
    kind: str
    reason: str
    metrics: Mapping[str, float | int | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", dict(self.metrics))

    def to_dict(self) -> dict[str, Any]:
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
