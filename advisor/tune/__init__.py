"""Trials and the search for the fastest stable policy: five stages composed by ``_engine``
(``_plan``, ``_run``, ``_judge``, ``_confirm``, ``_answer``), timing noise behind the ``Timing``
strategy in ``_steady``, and ``_service``, which tunes a script end to end. Nothing here imports
the frameworks, the daemon or the CLI.
"""

from __future__ import annotations

from advisor.tune._checks import check_modes, check_script, default_trial_modes
from advisor.tune._engine import TuneResult
from advisor.tune._judge import Evaluation, curve_of
from advisor.tune._options import OptionInfo, TuneOptions, option_info
from advisor.tune._pairs import PAIRS_MAX, PairedRuns, pairs_runs, run_pairs
from advisor.tune._run import WAIT_IDLE_ENV, ScriptRunner, TrialSettings, prestarted_launcher
from advisor.tune._service import (
    ScriptLaunch,
    ScriptTune,
    TuneRequest,
    check_judgeable_window,
    default_storage,
    default_storage_url,
    run_ratio_text,
    study_name_for,
    tune,
    tune_plan,
    tune_script,
)
from advisor.tune._space import Measured, SpaceLimits
from advisor.tune._stability import Basis, StabilityThresholds, TrialCurve, basis, smooth
from advisor.tune._steady import CpuTiming, DisturbanceWatch, GpuTiming, SteadyRunner, timing_for
from advisor.tune._storage import resolve_storage, shared_storage, shown_url
from advisor.tune._study_status import finished_trials, study_status
from advisor.tune._trials import Comparison, run_comparison

__all__ = [
    "Basis", "Comparison", "CpuTiming", "DisturbanceWatch", "Evaluation", "GpuTiming", "Measured",
    "OptionInfo", "PAIRS_MAX", "PairedRuns", "ScriptLaunch", "ScriptRunner", "ScriptTune",
    "SpaceLimits", "StabilityThresholds", "SteadyRunner", "TrialCurve", "TrialSettings",
    "TuneOptions", "TuneRequest", "TuneResult", "WAIT_IDLE_ENV", "basis", "check_judgeable_window",
    "check_modes", "check_script", "curve_of", "default_storage", "default_storage_url",
    "default_trial_modes", "finished_trials", "option_info", "pairs_runs", "prestarted_launcher",
    "resolve_storage", "run_comparison", "run_pairs", "run_ratio_text", "shared_storage",
    "shown_url", "smooth", "study_name_for", "study_status", "timing_for", "tune", "tune_plan",
    "tune_script",
]
