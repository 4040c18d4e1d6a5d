"""``advisor.tune(train_fn)``: the tuner in this process, for notebooks and tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import probes
from advisor.tune._engine import TuneResult, tune_policy
from advisor.tune._stability import StabilityThresholds
from advisor.tune._trials import FunctionRunner, TrialSettings


def tune(
    train_fn: Callable[[Any], Any],
    *,
    trials: int | None = 20,
    time_budget: float | None = None,
    steps: int = 40,
    warmup: int = 5,
    seed: int = 0,
    device: str | None = None,
    modes: list[str] | None = None,
    scale_batch: bool = False,
    include_emulated: bool = False,
    memory_limit: int | None = None,
    thresholds: StabilityThresholds | None = None,
    use_priors: bool = True,
    remeasure: bool = True,
    storage: str | None = None,
    study_name: str = "mpadvise-in-process",
    resume: bool = False,
    out: str | os.PathLike[str] | None = None,
) -> TuneResult:
    """Tune a training function in this process: the same trials, verdicts and search as
    ``mpadvise tune``, without subprocesses.

    ``train_fn(mp)`` receives the candidate's AppliedPolicy and trains as a script would
    (``mp.setup``, ``mp.micro_batch_size``, ``mp.autocast``, ``mp.step``); it must build its
    model and data inside so every candidate starts from the same seed. A trial ends once its
    steps are measured. Out-of-memory and crashes are classified, not raised; a hard crash
    (segfault) takes the process with it, which is what ``mpadvise tune``'s subprocesses avoid.

    Args:
        train_fn: the training function.
        trials: trial budget of the search.
        time_budget: seconds after which no new trial starts.
        steps: measured optimizer steps per trial; warmup: untimed steps before them.
        seed: seed of every trial.
        device: ``"cpu"``/``"cuda:N"``; default: the first GPU, else the CPU.
        modes: restrict the search to these modes.
        scale_batch: allow larger global batches.
        include_emulated: search FP8 emulated on a CPU too.
        memory_limit: bytes; candidates over it are infeasible.
        thresholds: stability thresholds.
        use_priors: stop early when no untried candidate can beat the best.
        remeasure: re-measure close candidates before declaring a winner.
        storage, study_name, resume: Optuna storage for the study (in memory by default).
        out: also write the winner to this config file.

    Returns:
        A TuneResult: ``.policy`` is the winner (``None`` when nothing was stable).
    """

    settings = TrialSettings(warmup_steps=warmup, measure_steps=steps, seed=seed, memory_limit=memory_limit, device=device)
    profile = probes.profile_for(device)
    result = tune_policy(
        FunctionRunner(train_fn, settings), profile, trials=trials, time_budget=time_budget, scale_batch=scale_batch,
        include_emulated=include_emulated, modes=modes, memory_limit=memory_limit, storage=storage,
        study_name=study_name, resume=resume, seed=seed, thresholds=thresholds, use_priors=use_priors,
        remeasure=remeasure, workload={"script": getattr(train_fn, "__qualname__", None)},
    )
    if out is not None and result.policy is not None:
        result.policy.save(Path(out))
    return result
