"""The Optuna search over precision mode, loss scaling and micro-batch size.

The only module that imports optuna. The trial runner is passed in (``evaluate``), so the
search logic runs in milliseconds against a fake in the unit tests. Unstable and out-of-memory
candidates are reported as constraint violations (``Trial.set_constraint``), which TPE learns
from, not as failures, which it ignores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from advisor.tune._space import Candidate, Measured, SearchSpace, preference_key, upper_bound
from probes import MpadviseError

STUDY_ATTR_SPACE = "mpadvise:space"
TRIAL_ATTR_RESULT = "mpadvise:result"
MAX_DUPLICATE_PROPOSALS = 3


@dataclass
class SearchOutcome:
    """What the search ran and why it stopped."""

    measured: dict[Candidate, Measured] = field(default_factory=dict)
    order: list[Candidate] = field(default_factory=list)  # candidates in the order they ran
    runs: int = 0  # trials actually run in this invocation (resumed ones are not counted)
    resumed: int = 0
    stop_reason: str = ""
    wall_s: float = 0.0


def _suggest(trial: Any, space: SearchSpace) -> Candidate:
    mode = trial.suggest_categorical("mode", list(space.modes))
    micro = trial.suggest_categorical("micro_batch", list(space.micro_batches)) if space.micro_batches else None
    if mode != "fp16-mixed":
        return space.normalise(Candidate(mode, micro))
    kind = trial.suggest_categorical("loss_scale", ["dynamic", "static"])
    init = trial.suggest_categorical("init_scale", [2.0**8, 2.0**12, 2.0**16])
    growth = trial.suggest_categorical("growth_interval", [500, 2000]) if kind == "dynamic" else None
    return space.normalise(Candidate(mode, micro, kind, init, growth))


def check_storage(storage: str | None) -> None:
    """Open the Optuna storage once, so a bad URL fails before any trial runs.

    Raises:
        MpadviseError: naming the URL and the reason.
    """
    if storage is None:
        return
    import optuna

    try:
        optuna.storages.get_storage(storage)
    except Exception as exc:  # bad dialect, unreachable server, unwritable file
        raise MpadviseError(f"cannot open the Optuna study storage {storage!r}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _load_study(storage: str | None, study_name: str, *, resume: bool, seed: int) -> Any:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=4)
    try:
        if not resume and storage is not None:
            try:
                optuna.delete_study(study_name=study_name, storage=storage)
            except KeyError:  # no such study yet
                pass
        return optuna.create_study(
            study_name=study_name, storage=storage, direction="maximize", sampler=sampler, load_if_exists=resume
        )
    except Exception as exc:  # a bad URL, an unreachable server, a locked file
        raise MpadviseError(f"cannot open the Optuna study storage {storage!r}: {_first_line(exc)}") from None


def run_search(
    space: SearchSpace,
    evaluate: Callable[[Candidate], Measured],
    *,
    first: list[Candidate],
    reference_goodput: float,
    dtype_ratio: dict[str, float],
    max_trials: int | None,
    time_budget: float | None,
    storage: str | None = None,
    study_name: str = "mpadvise",
    resume: bool = False,
    seed: int = 0,
    use_priors: bool = True,
    known: dict[Candidate, Measured] | None = None,
    on_trial: Callable[[Candidate, Measured], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> SearchOutcome:
    """Search ``space`` for the fastest stable candidate.

    Args:
        space: the candidates allowed on this hardware.
        evaluate: runs one candidate (a subprocess trial, or a fake in tests).
        first: candidates enqueued before the sampler takes over (fp32, the safe default).
        reference_goodput: fp32's goodput, for the priors.
        dtype_ratio: matmul TFLOP/s ratio to fp32 per dtype on this device (the priors).
        max_trials: stop after this many trials run here (``None``: no limit).
        time_budget: stop starting trials after this many seconds (``None``: no limit).
        storage: Optuna storage URL (SQLite file, PostgreSQL...), ``None`` for in memory.
        study_name: the study's name in that storage.
        resume: continue a stored study: its trials are not run again.
        use_priors: stop early once no untried candidate can beat the best.
        known: candidates already measured (the reference), reused without running.
        on_trial: called after each candidate is evaluated.
        clock: monotonic seconds (tests pass a fake).

    Returns:
        Every measured candidate and why the search stopped.
    """
    import optuna

    start = clock()
    outcome = SearchOutcome()
    outcome.measured.update(known or {})
    study = _load_study(storage, study_name, resume=resume, seed=seed)
    space_json = json.dumps({"modes": space.modes, "micro_batches": space.micro_batches, "user_batch": space.user_batch})
    stored_space = study.user_attrs.get(STUDY_ATTR_SPACE)
    if stored_space is not None and stored_space != space_json:
        raise MpadviseError(
            f"study {study_name!r} was made for another search space ({stored_space}); "
            "run without --resume to start a fresh study"
        )
    study.set_user_attr(STUDY_ATTR_SPACE, space_json)
    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        data = frozen.user_attrs.get(TRIAL_ATTR_RESULT)
        if data:
            m = _measured_from(data)
            if m.candidate not in outcome.measured:
                outcome.resumed += 1
            outcome.measured[m.candidate] = m
            outcome.order.append(m.candidate)
    grid = space.grid()
    done_params = [t.params for t in study.get_trials(deepcopy=False)]
    for cand in first:
        cand = space.normalise(cand)
        if cand.params() not in done_params:
            study.enqueue_trial(cand.params(), skip_if_exists=True)

    duplicates = 0
    while True:
        if max_trials is not None and outcome.runs >= max_trials:
            outcome.stop_reason = f"trial budget reached ({max_trials} trials)"
            break
        if time_budget is not None and clock() - start >= time_budget:
            outcome.stop_reason = f"time budget reached ({time_budget:g} s)"
            break
        untried = [c for c in grid if c not in outcome.measured]
        if not untried:
            outcome.stop_reason = f"every candidate of the space was measured ({len(grid)})"
            break
        if use_priors:
            best = best_goodput(outcome.measured)
            bounds = {c: upper_bound(c, outcome.measured, user_batch=space.user_batch,
                                     reference_goodput=reference_goodput, dtype_ratio=dtype_ratio) for c in untried}
            promising = [c for c, b in bounds.items() if b > best]
            if not promising:
                outcome.stop_reason = (
                    f"no untried candidate can beat the best ({len(untried)} left; bounded by the measured "
                    "matmul ratios, memory fit and measured variants)"
                )
                break
        else:
            promising = untried
        trial = study.ask()
        candidate = _suggest(trial, space)
        if candidate in outcome.measured or candidate not in promising:
            # Tell the sampler what is known (or bounded) without running anything.
            known_m = outcome.measured.get(candidate)
            value = known_m.goodput if known_m else 0.0
            _tell(study, trial, known_m or Measured(candidate, 0.0, feasible=False, stable=False), value)
            duplicates += 1
            if duplicates >= MAX_DUPLICATE_PROPOSALS:
                # The sampler keeps proposing what is known: pick the most promising untried one.
                pick = max(promising, key=lambda c: (upper_bound(c, outcome.measured, user_batch=space.user_batch,
                                                                reference_goodput=reference_goodput,
                                                                dtype_ratio=dtype_ratio) if use_priors else 0.0,
                                                     [-x for x in preference_key(c, space.user_batch)]))
                study.enqueue_trial(pick.params())
                duplicates = 0
            continue
        duplicates = 0
        measured = evaluate(candidate)
        outcome.runs += 1
        outcome.measured[candidate] = measured
        outcome.order.append(candidate)
        _tell(study, trial, measured, measured.goodput)
        if on_trial:
            on_trial(candidate, measured)
    outcome.wall_s = clock() - start
    return outcome


def _tell(study: Any, trial: Any, measured: Measured, value: float) -> None:
    # Constraints (> 0 violates): instability and not fitting are what TPE must learn to avoid.
    trial.set_constraint("unstable", 0.0 if measured.stable else 1.0)
    trial.set_constraint("infeasible", 0.0 if measured.feasible else 1.0)
    trial.set_user_attr(TRIAL_ATTR_RESULT, _measured_to(measured))
    study.tell(trial, value)


def best_goodput(measured: dict[Candidate, Measured]) -> float:
    stable = [m.goodput for m in measured.values() if m.feasible and m.stable]
    return max(stable, default=0.0)


def _measured_to(m: Measured) -> dict[str, Any]:
    c = m.candidate
    return {
        "mode": c.mode, "micro_batch": c.micro_batch, "loss_scale": c.loss_scale, "init_scale": c.init_scale,
        "growth_interval": c.growth_interval, "goodput": m.goodput, "feasible": m.feasible, "stable": m.stable,
        "oom": m.oom, "outcome": m.outcome, "reason": m.reason[:2000],
    }


def _measured_from(data: dict[str, Any]) -> Measured:
    cand = Candidate(data["mode"], data.get("micro_batch"), data.get("loss_scale"), data.get("init_scale"), data.get("growth_interval"))
    return Measured(
        cand, float(data["goodput"]), bool(data["feasible"]), bool(data["stable"]), bool(data.get("oom", False)),
        str(data.get("outcome", "")), str(data.get("reason", "")),
    )
