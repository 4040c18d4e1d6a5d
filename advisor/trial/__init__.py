"""Trials: one run of a training script under one candidate policy, and what it reports. The
parent launches, merges ranks and classifies; the child (``_child``) applies and records."""

from __future__ import annotations

from ._child import (
    UNDERFLOW_EVERY,
    FrameworkRecorder,
    applied_for_trial,
    optimizer_eps,
    recorder_for,
    run_in_process,
    spec_from_env,
    trial_candidate,
)
from ._classify import classify
from ._launch import run_trial, trial_environment
from ._python_command import RUN_MODULE
from ._rank_merge import merge_rank_results
from ._ranks import STORE_ENV, ranks_argv
from ._schema import (
    DEFAULT_MEASURE_STEPS,
    DEFAULT_WARMUP_STEPS,
    EXIT_NO_STEP,
    EXIT_UNSUPPORTED,
    OUTCOMES,
    POLICY_ENV,
    RESULT_FIELDS,
    TRIAL_SPEC_ENV,
    Stage,
    TrialResult,
    TrialSpec,
    json_float,
    parse_memory,
    rank_result_path,
)
from ._step_window import ResultWriter, end_trial_process, install_excepthook, seed_everything
from ._timeline import PHASES, TIMELINE_MARKS, breakdown, startup_seconds
from ._warm import WARM_ENV, WarmLauncher, framework_preload

__all__ = [
    "DEFAULT_MEASURE_STEPS", "DEFAULT_WARMUP_STEPS", "EXIT_NO_STEP", "EXIT_UNSUPPORTED", "OUTCOMES",
    "PHASES", "POLICY_ENV", "RESULT_FIELDS", "RUN_MODULE", "STORE_ENV", "TIMELINE_MARKS",
    "TRIAL_SPEC_ENV", "UNDERFLOW_EVERY", "WARM_ENV", "FrameworkRecorder", "ResultWriter", "Stage",
    "TrialResult", "TrialSpec", "WarmLauncher", "applied_for_trial", "breakdown", "classify",
    "end_trial_process", "framework_preload", "install_excepthook", "json_float",
    "merge_rank_results", "parse_memory", "optimizer_eps", "rank_result_path", "ranks_argv",
    "recorder_for", "run_in_process", "run_trial", "seed_everything", "spec_from_env",
    "startup_seconds", "trial_candidate", "trial_environment"
]
