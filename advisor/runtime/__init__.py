"""The runtime a training script meets: ``AppliedPolicy``, the fallback and the guard, batch
splits, FSDP2's precision and workload fingerprints. It uses ``policies`` and ``probes`` only."""

from __future__ import annotations

from advisor.runtime._applied import AppliedPolicy, StepObserver
from advisor.runtime._fallback import fallback_words, guard_fallback, safe_fallback
from advisor.runtime._guard import GUARD_ENV, Guard, GuardEvent, GuardLimits, guard_setting
from advisor.runtime._setup import FsdpPrecision, fsdp_precision
from advisor.runtime._split import BatchSplit, batch_split, tuned_global_batch
from advisor.runtime._workload import Workload, current_world_size, model_signature, script_digest

__all__ = [
    "GUARD_ENV", "AppliedPolicy", "BatchSplit", "FsdpPrecision", "Guard", "GuardEvent",
    "GuardLimits", "StepObserver", "Workload", "batch_split", "current_world_size",
    "fallback_words", "fsdp_precision", "guard_fallback", "guard_setting", "model_signature",
    "safe_fallback", "script_digest", "tuned_global_batch",
]
