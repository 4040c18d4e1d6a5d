"""Trials: one run of a training script under one candidate policy, and what it reports.

The protocol between the two processes lives here and nowhere else:

* the parent side (``_protocol``): ``TrialSpec`` (what to run), ``run_trial`` (the launcher,
  with its process-tree handling in ``_proctree``), the result file, ``TrialResult`` and
  ``classify`` (the pure outcome decision), and the merge of several ranks' results;
* the child side (``_child``): what ``load_policy()`` does when a candidate is injected, and
  the recorder that ``step()`` feeds; ``_recorder`` is the same recorder fed by a framework's
  hooks (Lightning, the HF Trainer, Accelerate).

Arrows: this package uses ``runtime`` (the applied policy and its step hook, workload
fingerprints); ``tune`` (which judges trials) and ``frameworks`` (which apply a policy inside
a framework) use it.
"""

from __future__ import annotations

from ._child import (
    UNDERFLOW_EVERY,
    applied_for_trial,
    end_trial_process,
    install_excepthook,
    run_in_process,
    seed_everything,
    spec_from_env,
    trial_candidate,
)
from ._protocol import (
    EXIT_NO_STEP,
    EXIT_UNSUPPORTED,
    TrialResult,
    TrialSpec,
    classify,
    json_float,
    parse_memory,
    run_trial,
)
from ._recorder import FrameworkRecorder, recorder_for

__all__ = [
    "EXIT_NO_STEP",
    "EXIT_UNSUPPORTED",
    "UNDERFLOW_EVERY",
    "FrameworkRecorder",
    "TrialResult",
    "TrialSpec",
    "applied_for_trial",
    "classify",
    "end_trial_process",
    "install_excepthook",
    "json_float",
    "parse_memory",
    "recorder_for",
    "run_in_process",
    "run_trial",
    "seed_everything",
    "spec_from_env",
    "trial_candidate",
]
