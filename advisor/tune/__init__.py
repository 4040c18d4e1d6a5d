"""Trials and the search: run candidates (subprocess or in process), judge their stability
against the fp32 reference, time them fairly, and search for the fastest stable policy.

The tune is five stages, one module each, composed by ``_engine``: ``_plan`` (space, priors,
bounds), ``_run`` (trials through one runner interface, warm or cold), ``_judge`` (verdicts
against fp32, with ``_reference`` for the fp32 yardsticks and ``_stability`` for the verdict:
its data in ``_curves``, its measurements in ``_comparison``, its checks in ``_verdict_rules``),
``_confirm`` (a bounded paired re-measure of close finalists) and ``_answer`` (the winner, its
speed-up and the data the report, config and cache need). ``_trials`` is the tune's trial book.
Timing noise sits behind one ``Timing`` strategy in ``_steady`` (with the statistics in
``_timing``). Around them: ``_space`` (candidates and priors), ``_search`` (the Optuna
ask-and-tell loop), the study storage behind it (``_storage``: URLs, opening, errors;
``_storage_retry``: outages ridden out; ``_study``: the study's records, claims, heartbeats,
asks and tells; ``_study_status``: reads before a tune and ``study status``), ``_service`` (one
tune of a script end to end: study, storage, config file, cache entry), ``_api`` (``advisor.tune``), ``_checks`` (script and mode checks before a run),
``_options`` (the tune options, declared once for the CLI, the API and the daemon), and ``job``
(``python -m advisor.tune.job REQUEST.json RESULT.json``, the daemon's entry point). Arrows: tune
uses ``trial``, ``runtime`` and ``cache`` (to record its answer), ``policies`` and ``probes``;
nothing in it imports the frameworks, the daemon or the CLI.
"""

from __future__ import annotations

from advisor.tune._api import tune
from advisor.tune._checks import check_modes, check_script, default_trial_modes
from advisor.tune._dryrun import tune_plan
from advisor.tune._engine import TuneResult
from advisor.tune._options import (
    DEFAULT_MEASURE_STEPS,
    DEFAULT_WARMUP_STEPS,
    OptionInfo,
    TuneOptions,
    check_rank_device,
    option_info,
)
from advisor.tune._pairs import PAIRS_MAX, PairedRuns, pairs_runs, run_pairs
from advisor.tune._service import (
    EXIT_FOUND,
    EXIT_NONE_STABLE,
    ScriptLaunch,
    ScriptTune,
    TuneProgress,
    TuneRequest,
    calls_load_policy,
    check_judgeable_window,
    default_storage,
    default_storage_url,
    keep_answer,
    run_ratio_text,
    study_name_for,
    study_name_from,
    tune_script,
)
from advisor.tune._space import Measured, SpaceLimits
from advisor.tune._stability import Basis, StabilityThresholds, TrialCurve, basis, smooth
from advisor.tune._steady import (
    CpuTiming,
    DisturbanceWatch,
    GpuTiming,
    SteadyRunner,
    Timing,
    timing_for,
)
from advisor.tune._storage import resolve_storage, shared_storage, shown_url
from advisor.tune._study_status import KeptStudy, finished_trials, kept_study, study_status
from advisor.tune._trials import (
    WAIT_IDLE_ENV,
    Comparison,
    Evaluation,
    ScriptRunner,
    TrialSettings,
    curve_of,
    prestarted_launcher,
    run_comparison,
)

__all__ = [
    "Basis",
    "DisturbanceWatch",
    "SteadyRunner",
    "Timing",
    "CpuTiming",
    "GpuTiming",
    "timing_for",
    "Evaluation",
    "KeptStudy",
    "Measured",
    "SpaceLimits",
    "StabilityThresholds",
    "TrialCurve",
    "DEFAULT_MEASURE_STEPS",
    "DEFAULT_WARMUP_STEPS",
    "PAIRS_MAX",
    "PairedRuns",
    "EXIT_FOUND",
    "EXIT_NONE_STABLE",
    "WAIT_IDLE_ENV",
    "Comparison",
    "OptionInfo",
    "ScriptLaunch",
    "ScriptRunner",
    "ScriptTune",
    "TrialSettings",
    "TuneOptions",
    "TuneProgress",
    "TuneRequest",
    "TuneResult",
    "basis",
    "calls_load_policy",
    "check_judgeable_window",
    "check_modes",
    "check_rank_device",
    "check_script",
    "curve_of",
    "default_storage",
    "default_storage_url",
    "finished_trials",
    "kept_study",
    "default_trial_modes",
    "keep_answer",
    "option_info",
    "prestarted_launcher",
    "resolve_storage",
    "run_comparison",
    "run_pairs",
    "pairs_runs",
    "shared_storage",
    "study_status",
    "shown_url",
    "smooth",
    "run_ratio_text",
    "study_name_for",
    "study_name_from",
    "tune",
    "tune_plan",
    "tune_script",
]
