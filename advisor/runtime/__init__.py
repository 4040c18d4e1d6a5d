"""The runtime a training script meets: ``AppliedPolicy`` (setup, autocast, step, checkpoints)
and the workload fingerprints it takes of the model and optimizer.

Public surface: ``AppliedPolicy`` and its step hook ``StepObserver``; the safe fallback when a
tuned policy does not apply (``safe_fallback``, ``fallback_words``); how a global batch splits
into micro-batches (``BatchSplit``, ``batch_split``, ``tuned_global_batch``); FSDP2's mixed
precision (``FsdpPrecision``, ``fsdp_precision``); and the workload's fingerprints
(``Workload``, ``model_signature``, ``workload_fingerprint``, ``script_digest``), with the
number of processes training together (``current_world_size``); the guard that watches a long run's steps (``Guard``,
``GuardEvent``, ``GuardLimits``, ``guard_setting``, ``guard_fallback``, ``GUARD_ENV``), with its
slow signals (``LossTrend``, ``UpdateProbe``; ``BEHIND``, ``CLIMB``, ``STALL``).

Arrows: runtime uses ``policies`` and ``probes`` only; ``trial``, ``tune`` and the loader build
on it.
"""

from __future__ import annotations

from advisor.runtime._applied import AppliedPolicy, StepObserver
from advisor.runtime._fallback import fallback_words, guard_fallback, safe_fallback
from advisor.runtime._fsdp import FsdpPrecision, fsdp_precision
from advisor.runtime._guard import (
    GUARD_ENV,
    GUARD_SETTINGS,
    Guard,
    GuardEvent,
    GuardLimits,
    guard_setting,
)
from advisor.runtime._split import BatchSplit, batch_split, tuned_global_batch
from advisor.runtime._trend import BEHIND, CLIMB, STALL, LossTrend, UpdateProbe
from advisor.runtime._workload import (
    Workload,
    current_world_size,
    model_signature,
    script_digest,
    workload_fingerprint,
)

__all__ = [
    "BEHIND",
    "CLIMB",
    "STALL",
    "LossTrend",
    "UpdateProbe",
    "GUARD_ENV",
    "GUARD_SETTINGS",
    "Guard",
    "GuardEvent",
    "GuardLimits",
    "guard_fallback",
    "guard_setting",
    "AppliedPolicy",
    "BatchSplit",
    "FsdpPrecision",
    "StepObserver",
    "Workload",
    "batch_split",
    "current_world_size",
    "fallback_words",
    "fsdp_precision",
    "model_signature",
    "safe_fallback",
    "script_digest",
    "tuned_global_batch",
    "workload_fingerprint",
]
