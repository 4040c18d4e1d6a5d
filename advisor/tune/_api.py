"""``advisor.tune(train_fn)``: the tuner in this process, for notebooks and tests."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import probes
from advisor.tune._engine import TuneResult, tune_policy
from advisor.tune._options import TuneOptions
from advisor.tune._service import remember
from advisor.tune._stability import StabilityThresholds
from advisor.tune._study_status import check_study
from advisor.tune._trials import FunctionRunner, TrialSettings


def tune(
    train_fn: Callable[[Any], Any], options: TuneOptions | None = None, *,
    thresholds: StabilityThresholds | None = None, remeasure: bool = True, study_name: str = "mpadvise-in-process",
    **option_values: Any,
) -> TuneResult:
    """Tune a training function in this process: the same trials, verdicts and search as
    ``mpadvise tune``, without subprocesses.

    ``train_fn(mp)`` receives the candidate's AppliedPolicy and trains as a script would; it must
    build its model and data inside so every candidate starts from the same seed. Out-of-memory and
    crashes are classified, not raised; a hard crash (segfault) takes the process with it. The
    winner is cached under the file that defines ``train_fn``, so that its
    ``advisor.load_policy()`` finds it; a notebook cell's is not cached.

    Args:
        train_fn: the training function.
        options: the tune's options, as ``mpadvise tune`` takes them (:class:`TuneOptions`).
        thresholds: stability thresholds.
        remeasure: re-measure close candidates, and the winner against fp32 for its speed-up;
            without it the speed-up rests on single runs.
        study_name: the Optuna study's name in ``storage``.
        **option_values: :class:`TuneOptions` fields by name, over ``options`` (``storage``
            defaults to memory; with neither ``resume`` nor ``fresh``, a stored study that holds
            finished trials is refused, as on the command line).

    Returns:
        A TuneResult: ``.policy`` is the winner (``None`` when nothing was stable).
    """
    options = (options or TuneOptions()).with_(**option_values)
    profile = probes.profile_for(options.device)
    check_study(options.storage, study_name, hardware=probes.hardware_fingerprint(profile), resume=options.resume,
                fresh=options.fresh, spelling=("resume=True", "fresh=True"))
    runner = FunctionRunner(train_fn, TrialSettings.for_tune(options))
    result = tune_policy(
        runner, profile, options, study_name=study_name, thresholds=thresholds, remeasure=remeasure,
        workload={"script": getattr(train_fn, "__qualname__", None)},
    )
    if options.out is not None and result.policy is not None:
        result.policy.save(Path(options.out))
    try:
        source = inspect.getsourcefile(train_fn)
    except TypeError:  # a builtin, or a callable object without code
        source = None
    if not options.no_cache and source is not None and Path(source).is_file():
        remember(result, profile, source, None)
    return result
