"""Trials and the search: run candidates (subprocess or in process), judge their stability
against the fp32 reference, time them fairly, and search for the fastest stable policy.

Modules: ``_trials`` (runners and evaluations), ``_child`` (inside a trial process),
``_stability`` (verdicts), ``_timing`` (noise-aware comparisons), ``_space`` (candidates and
priors), ``_search`` (Optuna), ``_engine`` (the tune), ``_api`` (``advisor.tune``), ``_checks``
(script and mode checks before a run), ``_options`` (the tune options, declared once for the
CLI, the API and the daemon). Arrows: tune uses ``runtime``, ``policies`` and
``probes``; nothing in it imports the cache, the daemon or the CLI.
"""

from __future__ import annotations

from advisor.tune._api import tune
from advisor.tune._options import TuneOptions

__all__ = ["TuneOptions", "tune"]
