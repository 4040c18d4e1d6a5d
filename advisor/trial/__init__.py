"""Trials: one run of a training script under one candidate policy, and what it reports.

The protocol between the two processes lives here and nowhere else:

* the schema both sides share (``_schema``): ``TrialSpec`` (what to run), the result file (its
  fields declared once in ``RESULT_FIELDS``, its stages in ``Stage``), ``TrialResult``, and the
  child's environment (``TRIAL_SPEC_ENV``, ``POLICY_ENV``), named once for the launcher that
  sets it and the child that reads it;
* the parent side: ``run_trial`` (``_launch``, the launcher, with its process-tree handling in
  ``_proctree``), ``classify`` (``_classify``, the pure outcome decision, which rejects a result
  with an undeclared field), the merge of several ranks' results (``_rank_merge``), the memory
  cgroup's OOM kills (``_oom_kills``) and where a timed-out trial hung (``_stacks``);
* the child side: what ``load_policy()`` does when a candidate is injected (``_child``), how
  the child writes its result and ends (``_child_exit``: ``ResultWriter``), and the recorder
  that ``step()`` feeds (``_loop_recorder``); ``_recorder`` is the same recorder fed by a
  framework's hooks (Lightning, the HF Trainer, Accelerate). Both share the measured window
  (``_step_window``), which builds the result file's measurements in one place
  (``result_payload``), and what it measures with: the device's clock and memory (``_device``,
  ``_peak_memory``), the first-step watchdog (``_watchdog``), the FLOP count (``_flops``), the
  fp16 underflow (``_underflow``) and the seeds and perturbation (``_seeding``).

Arrows: this package uses ``runtime`` (the applied policy and its step hook, workload
fingerprints); ``tune`` (which judges trials) and ``frameworks`` (which apply a policy inside
a framework) use it.
"""

from __future__ import annotations

from ._child import applied_for_trial, run_in_process, spec_from_env, trial_candidate
from ._child_exit import ResultWriter, end_trial_process, install_excepthook
from ._classify import classify
from ._cold_reasons import WARM_ENV, framework_preload
from ._launch import run_trial, trial_environment
from ._python_command import RUN_MODULE
from ._rank_merge import merge_rank_results
from ._ranks import EXITS_ENV, STORE_ENV, ranks_argv
from ._recorder import FrameworkRecorder, recorder_for
from ._schema import (
    DEFAULT_MEASURE_STEPS,
    DEFAULT_WARMUP_STEPS,
    EXIT_NO_STEP,
    EXIT_UNSUPPORTED,
    OUTCOMES,
    POLICY_ENV,
    RESULT_FIELDS,
    TRIAL_SPEC_ENV,
    ResultField,
    Stage,
    TrialResult,
    TrialSpec,
    json_float,
    parse_memory,
    rank_result_path,
)
from ._seeding import perturb_parameters, seed_everything
from ._step_window import StepWindow
from ._timeline import PHASES, TIMELINE_MARKS, breakdown, startup_seconds
from ._underflow import UNDERFLOW_EVERY, optimizer_eps
from ._warm import WarmLauncher

__all__ = [
    "DEFAULT_MEASURE_STEPS",
    "DEFAULT_WARMUP_STEPS",
    "EXITS_ENV",
    "EXIT_NO_STEP",
    "EXIT_UNSUPPORTED",
    "OUTCOMES",
    "PHASES",
    "POLICY_ENV",
    "RESULT_FIELDS",
    "RUN_MODULE",
    "STORE_ENV",
    "TIMELINE_MARKS",
    "TRIAL_SPEC_ENV",
    "UNDERFLOW_EVERY",
    "WARM_ENV",
    "FrameworkRecorder",
    "ResultField",
    "ResultWriter",
    "Stage",
    "StepWindow",
    "TrialResult",
    "TrialSpec",
    "WarmLauncher",
    "applied_for_trial",
    "breakdown",
    "classify",
    "end_trial_process",
    "framework_preload",
    "install_excepthook",
    "json_float",
    "merge_rank_results",
    "parse_memory",
    "optimizer_eps",
    "perturb_parameters",
    "rank_result_path",
    "ranks_argv",
    "recorder_for",
    "run_in_process",
    "run_trial",
    "seed_everything",
    "spec_from_env",
    "startup_seconds",
    "trial_candidate",
    "trial_environment",
]
