"""The runtime a training script meets: ``AppliedPolicy`` (setup, autocast, step, checkpoints)
and the workload fingerprints it takes of the model and optimizer.

Arrows: runtime uses ``policies`` and ``probes`` only; ``tune`` and the loader build on it.
"""

from __future__ import annotations

from advisor.runtime._applied import AppliedPolicy, FsdpPrecision, StepObserver, fsdp_precision
from advisor.runtime._workload import model_signature, workload_fingerprint

__all__ = ["AppliedPolicy", "FsdpPrecision", "StepObserver", "fsdp_precision", "model_signature", "workload_fingerprint"]
