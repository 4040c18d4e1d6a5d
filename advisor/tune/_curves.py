"""The data of a stability verdict: the curves a trial records, the limits, and the verdict."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

VERDICT_KINDS: tuple[str, ...] = ("ok", "diverged", "stalled", "skips", "scale_collapse", "underflow",
                                  "reference_not_finite", "too_short")


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
        skipped = tuple(self.skipped)
        for i, s in enumerate(skipped):
            if not isinstance(s, bool):
                raise ValueError(f"TrialCurve.skipped[{i}] must be a bool, got {s!r}")
        scales = _optional_floats("loss_scale", self.loss_scale, ">= 0", lambda v: v >= 0.0)
        underflow = _optional_floats("underflow", self.underflow, "a fraction in [0, 1]",
                                     lambda v: 0.0 <= v <= 1.0)
        for name, values in (("skipped", skipped), ("loss_scale", scales), ("underflow", underflow)):
            if values and len(values) != len(losses):
                raise ValueError(f"TrialCurve.{name} has {len(values)} entries but losses has {len(losses)}; "
                                 "record one per optimizer step, or leave it empty when not recorded")
            object.__setattr__(self, name, values)
        object.__setattr__(self, "losses", losses)
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
        highs = {"max_skip_fraction": 1.0, "max_underflow_fraction": 1.0, "min_reference_drop": 1.0,
                 "smoothing_fraction": 0.5}
        for f in fields(self):
            value, where = getattr(self, f.name), f"StabilityThresholds.{f.name}"
            if f.type == "int":
                least = 0 if f.name == "calibration_steps" else 1
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"{where} must be an integer >= {least}, got {value!r}")
                continue
            high = highs.get(f.name)
            if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value)
                    or value < 0.0 or (high is not None and value > high)):
                bound = ">= 0.0" if high is None else f"in [0.0, {high}]"
                raise ValueError(f"{where} must be a number {bound}, got {value!r}")
        if self.smoothing_fraction == 0.0:
            raise ValueError("StabilityThresholds.smoothing_fraction must be > 0 (a fraction of the steps), got 0.0")

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
        # Strict JSON has no NaN or inf: those are written as "nan", "inf" and "-inf".
        metrics = {k: v if isinstance(v, bool | int) or math.isfinite(v) else str(v) for k, v in self.metrics.items()}
        return {"stable": self.stable, "kind": self.kind, "reason": self.reason, "metrics": metrics}


def _as_float(name: str, index: int | None, value: Any) -> float:
    where = f"TrialCurve.{name}" + ("" if index is None else f"[{index}]")
    if isinstance(value, bool):
        raise ValueError(f"{where} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where} must be a number, got {value!r}") from None


def _optional_floats(name: str, values: Sequence[Any], what: str,
                     ok: Callable[[float], bool]) -> tuple[float | None, ...]:
    out = tuple(None if v is None else _as_float(name, i, v) for i, v in enumerate(values))
    for i, v in enumerate(out):
        if v is not None and not ok(v):
            raise ValueError(f"TrialCurve.{name}[{i}] must be {what} or None, got {v!r}")
    return out
