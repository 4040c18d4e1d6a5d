"""A trial's timeline: when each part of its life began and ended, for the per-trial breakdown.

Marks are ``time.time()``, so that the parent's (``launched``, ``exited``) and the child's read on
one clock. Standard library only: the runner marks torch's import before the project loads."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping

TIMELINE_MARKS: tuple[str, ...] = (
    "launched",  # parent: just before the trial's process was started (or forked)
    "torch_imported",  # child: ``import torch`` done
    "policy_applied",  # child: the candidate is applied (``load_policy()``, or a framework's install)
    "first_step",  # child: the first optimizer step ended
    "warmup_done",  # child: the last warm-up step ended (the measured window begins)
    "measured_done",  # child: the measured window ended
    "exited",  # parent: the trial's process was seen to end
)

PHASES: tuple[tuple[str, str, str], ...] = (
    ("startup", "launched", "torch_imported"),
    ("script_setup", "torch_imported", "policy_applied"),
    ("to_first_step", "policy_applied", "first_step"),
    ("warmup", "first_step", "warmup_done"),
    ("measured", "warmup_done", "measured_done"),
    ("exit", "measured_done", "exited"),
)

_marks: dict[str, float] = {}


def mark(name: str) -> None:
    """Record that ``name`` (one of ``TIMELINE_MARKS``) happened now; the first record stands."""
    _marks.setdefault(name, time.time())


def marks() -> dict[str, float]:
    return dict(_marks)


def clear() -> None:
    _marks.clear()


def _seconds(timeline: Mapping[str, float], begin: str, end: str) -> float | None:
    """From mark ``begin`` to mark ``end``; None where either is missing or they are out of order."""
    a, b = timeline.get(begin), timeline.get(end)
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (a, b))
    return b - a if ok and b >= a else None  # type: ignore[operator]


def breakdown(timeline: Mapping[str, float]) -> dict[str, float | None]:
    spans = {phase: _seconds(timeline, begin, end) for phase, begin, end in PHASES}
    return {phase: None if span is None else round(span, 6) for phase, span in spans.items()}


def startup_seconds(timeline: Mapping[str, float]) -> float | None:
    return _seconds(timeline, "launched", "first_step")


def merge_timelines(timelines: list[Mapping[str, float]]) -> dict[str, float]:
    """One timeline from several ranks': each mark at the latest rank, which the others wait for."""
    merged: dict[str, float] = {}
    for timeline in timelines:
        for name, at in timeline.items():
            if name in TIMELINE_MARKS and isinstance(at, (int, float)):
                merged[name] = max(merged.get(name, at), at)
    return merged
