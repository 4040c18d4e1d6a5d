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

from advisor.tune._options import TuneOptions
from advisor.tune._space import (
    FP16_GROWTH_INTERVALS,
    FP16_INIT_SCALES,
    SPLIT_KEEPS,
    Candidate,
    Measured,
    SearchSpace,
    preference_key,
    scales_loss,
    upper_bound,
)
from probes import MpadviseError

STUDY_ATTR_SPACE = "mpadvise:space"
STUDY_ATTR_REPLICATE = "mpadvise:replicate"  # fp32 under another seed: the verdicts' spread
TRIAL_ATTR_RESULT = "mpadvise:result"
MAX_DUPLICATE_PROPOSALS = 3


@dataclass
class SearchOutcome:
    """What the search ran and why it stopped."""

    measured: dict[Candidate, Measured] = field(default_factory=dict)
    order: list[Candidate] = field(default_factory=list)  # candidates in the order they ran
    # Proposals the priors ruled out, never run (here or in the resumed study), with the reason.
    pruned: dict[Candidate, str] = field(default_factory=dict)
    runs: int = 0  # trials actually run in this invocation (resumed ones are not counted)
    resumed: int = 0
    stop_reason: str = ""
    wall_s: float = 0.0


def _suggest(trial: Any, space: SearchSpace) -> Candidate:
    mode = trial.suggest_categorical("mode", list(space.modes))
    micro = trial.suggest_categorical("micro_batch", list(space.micro_batches)) if space.micro_batches else None
    if not scales_loss(mode):
        return space.normalise(Candidate(mode, micro))
    limits = space.limits
    kind = trial.suggest_categorical("loss_scale", [k for k in ("dynamic", "static") if k in limits.loss_scale_kinds])
    # Where the loss scale's settings cannot be applied (the HF Trainer), GradScaler's defaults
    # are the only choice, so the sampler is not offered settings that would never run.
    init = trial.suggest_categorical("init_scale", list(FP16_INIT_SCALES) if limits.loss_scale_settings else [65536.0])
    growth = None
    if kind == "dynamic":
        growth = trial.suggest_categorical("growth_interval", list(FP16_GROWTH_INTERVALS) if limits.loss_scale_settings else [2000])
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


def stored_replicate(storage: str | None, study_name: str) -> dict[str, Any] | None:
    """The fp32 replicate kept with a stored study, for ``--resume`` to reuse; ``None`` when
    the study is in memory, does not exist yet, or keeps none.

    Raises:
        MpadviseError: the storage cannot be opened, naming the URL and the reason.
    """
    if storage is None:
        return None
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=study_name, storage=storage)
    except KeyError:  # no such study yet: nothing to resume
        return None
    except Exception as exc:  # a bad URL, an unreachable server, a locked file
        raise MpadviseError(f"cannot open the Optuna study storage {storage!r}: {_first_line(exc)}") from None
    stored = study.user_attrs.get(STUDY_ATTR_REPLICATE)
    return stored if isinstance(stored, dict) else None


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
    options: TuneOptions,
    *,
    first: list[Candidate],
    reference_goodput: float,
    dtype_ratio: dict[str, float],
    study_name: str = "mpadvise",
    known: dict[Candidate, Measured] | None = None,
    on_trial: Callable[[Candidate, Measured], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    replicate: dict[str, Any] | None = None,
) -> SearchOutcome:
    """Search ``space`` for the fastest stable candidate.

    Args:
        space: the candidates allowed on this hardware.
        evaluate: runs one candidate (a subprocess trial, or a fake in tests).
        options: the tune's options; the search reads ``trials`` (trials run here),
            ``time_budget`` (no trial starts after it), ``storage`` (Optuna storage URL,
            ``None`` for in memory), ``resume`` (continue a stored study without running its
            trials again), ``seed`` (of the sampler) and ``no_priors`` (measure candidates even
            when no untried one can beat the best).
        first: candidates enqueued before the sampler takes over (fp32, the safe default).
        reference_goodput: fp32's goodput, for the priors.
        dtype_ratio: matmul TFLOP/s ratio to fp32 per dtype on this device (the priors).
        study_name: the study's name in that storage.
        known: candidates already measured (the reference), reused without running.
        on_trial: called after each candidate is evaluated.
        clock: monotonic seconds (tests pass a fake).
        replicate: the fp32 replicate (``Replicate.to_dict``), kept with the study so that a
            resumed tune judges against the same spread without running it again.

    Returns:
        Every measured candidate and why the search stopped.
    """
    start = clock()
    outcome = SearchOutcome()
    outcome.measured.update(known or {})
    study = _load_study(options.storage, study_name, resume=options.resume, seed=options.seed)
    _claim_space(study, space, study_name)
    if replicate is not None:
        study.set_user_attr(STUDY_ATTR_REPLICATE, replicate)
    _restore(study, outcome)
    grid = space.grid()
    _enqueue_first(study, space, first)
    priors = _Priors(space, reference_goodput, dtype_ratio, enabled=not options.no_priors)
    _search_loop(study, space, grid, evaluate, options, priors, outcome, lambda: clock() - start, on_trial)
    outcome.pruned = {c: why for c, why in outcome.pruned.items() if c not in outcome.measured}
    outcome.wall_s = clock() - start
    return outcome


def _search_loop(study: Any, space: SearchSpace, grid: list[Candidate], evaluate: Callable[[Candidate], Measured],
                 options: TuneOptions, priors: _Priors, outcome: SearchOutcome, elapsed: Callable[[], float],
                 on_trial: Callable[[Candidate, Measured], None] | None) -> None:
    """Ask the sampler, run what is promising and new, tell it the rest, until a budget is spent."""
    duplicates = 0
    while True:
        untried = [c for c in grid if c not in outcome.measured]
        outcome.stop_reason = _budget_spent(outcome, options, elapsed, untried, len(grid))
        if outcome.stop_reason:
            break
        promising = priors.promising(untried, outcome.measured)
        if not promising:
            outcome.stop_reason = (
                f"no untried candidate can beat the best ({len(untried)} left; bounded by the measured "
                "matmul ratios, memory fit and measured variants)"
            )
            break
        trial = study.ask()
        candidate = _suggest(trial, space)
        if candidate in outcome.measured or candidate not in promising:
            _tell_without_running(study, trial, candidate, outcome, priors)
            duplicates += 1
            if duplicates >= MAX_DUPLICATE_PROPOSALS:
                # The sampler keeps proposing what is known: pick the most promising untried one.
                study.enqueue_trial(_params(space, priors.most_promising(promising, outcome.measured)))
                duplicates = 0
            continue
        duplicates = 0
        _run_trial(study, trial, candidate, evaluate, outcome)
        if on_trial:
            on_trial(candidate, outcome.measured[candidate])


@dataclass(frozen=True)
class _Priors:
    """Upper bounds on what untried candidates could reach (matmul ratios, memory fit, measured
    variants); with ``enabled`` off, every untried candidate stays promising."""

    space: SearchSpace
    reference_goodput: float
    dtype_ratio: dict[str, float]
    enabled: bool

    def bound(self, candidate: Candidate, measured: dict[Candidate, Measured]) -> float:
        return upper_bound(candidate, measured, user_batch=self.space.user_batch,
                           reference_goodput=self.reference_goodput, dtype_ratio=self.dtype_ratio)

    def promising(self, untried: list[Candidate], measured: dict[Candidate, Measured]) -> list[Candidate]:
        """The untried candidates that could still beat the best stable one."""
        if not self.enabled:
            return untried
        best = best_goodput(measured)
        return [c for c in untried if self.bound(c, measured) > best]

    def why_pruned(self, candidate: Candidate, measured: dict[Candidate, Measured]) -> str:
        """Why the priors rule out ``candidate``, in words, with its bound and the best."""
        bound, best = self.bound(candidate, measured), best_goodput(measured)
        if bound <= 0:
            return ("not run: it cannot fit or stay stable (out of memory at a micro-batch no larger, or a "
                    f"micro-batch split of settings that failed as {' or '.join(sorted(SPLIT_KEEPS))}, which a "
                    "split cannot cure); --no-priors runs it")
        return (f"not run: the priors bound it at {bound:,.0f} samples/s (matmul ratio, measured variants), no "
                f"more than the best measured {best:,.0f}/s; --no-priors runs it")

    def most_promising(self, promising: list[Candidate], measured: dict[Candidate, Measured]) -> Candidate:
        """The highest bound (when enabled), the safest first among equals."""
        return max(promising, key=lambda c: (self.bound(c, measured) if self.enabled else 0.0,
                                             [-x for x in preference_key(c, self.space.user_batch)]))


def _claim_space(study: Any, space: SearchSpace, study_name: str) -> None:
    """Record the space in the study, refusing a stored study made for another one."""
    space_json = json.dumps({"modes": space.modes, "micro_batches": space.micro_batches, "user_batch": space.user_batch})
    stored_space = study.user_attrs.get(STUDY_ATTR_SPACE)
    if stored_space is not None and stored_space != space_json:
        raise MpadviseError(
            f"study {study_name!r} was made for another search space ({stored_space}); "
            "run without --resume to start a fresh study"
        )
    study.set_user_attr(STUDY_ATTR_SPACE, space_json)


def _restore(study: Any, outcome: SearchOutcome) -> None:
    """Take in what the study's completed trials measured (a resumed study); a proposal the
    priors pruned stays pruned, so that another run (``--no-priors``) may still measure it."""
    import optuna

    for frozen in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        data = frozen.user_attrs.get(TRIAL_ATTR_RESULT)
        if not data:
            continue
        m = _measured_from(data)
        # A measured result always has an outcome; an empty one is a pruned proposal stored
        # before pruned proposals were marked as such.
        if data.get("pruned") or not m.outcome:
            outcome.pruned.setdefault(m.candidate, m.reason or "not run: the priors ruled it out")
            continue
        if m.candidate not in outcome.measured:
            outcome.resumed += 1
        outcome.measured[m.candidate] = m
        outcome.order.append(m.candidate)


def _enqueue_first(study: Any, space: SearchSpace, first: list[Candidate]) -> None:
    """Queue the candidates that run before the sampler takes over, unless the study has them."""
    done_params = [t.params for t in study.get_trials(deepcopy=False)]
    for cand in first:
        params = _params(space, space.normalise(cand))
        if params not in done_params:
            study.enqueue_trial(params, skip_if_exists=True)


def _params(space: SearchSpace, candidate: Candidate) -> dict[str, object]:
    """The Optuna parameters that select ``candidate``, the micro-batch always named: an
    enqueued trial that leaves a parameter out has the sampler draw it."""
    params = candidate.params()
    if space.micro_batches and "micro_batch" not in params:
        params["micro_batch"] = space.user_batch
    return params


def _budget_spent(
    outcome: SearchOutcome, options: TuneOptions, elapsed: Callable[[], float], untried: list[Candidate], grid_size: int
) -> str:
    """Why the search stops before another trial (the trial or time budget, an exhausted
    space); empty while it goes on."""
    if outcome.runs >= options.trials:
        return f"trial budget reached ({options.trials} trials)"
    if options.time_budget is not None and elapsed() >= options.time_budget:
        return f"time budget reached ({options.time_budget:g} s)"
    if not untried:
        return f"every candidate of the space was measured ({grid_size})"
    return ""


def _tell_without_running(study: Any, trial: Any, candidate: Candidate, outcome: SearchOutcome,
                          priors: _Priors) -> None:
    """Tell the sampler what is known (or bounded) of a proposal, without running it.

    A pruned proposal is told as infeasible, which steers the sampler away from it, and is
    stored marked as pruned: it was never measured.
    """
    known = outcome.measured.get(candidate)
    if known is not None:
        _tell(study, trial, known, known.goodput)
        return
    reason = outcome.pruned[candidate] = priors.why_pruned(candidate, outcome.measured)
    _tell(study, trial, Measured(candidate, 0.0, feasible=False, stable=False, outcome="pruned", reason=reason),
          0.0, pruned=True)


def _run_trial(study: Any, trial: Any, candidate: Candidate, evaluate: Callable[[Candidate], Measured],
               outcome: SearchOutcome) -> None:
    measured = evaluate(candidate)
    outcome.runs += 1
    outcome.measured[candidate] = measured
    outcome.order.append(candidate)
    _tell(study, trial, measured, measured.goodput)


def _tell(study: Any, trial: Any, measured: Measured, value: float, *, pruned: bool = False) -> None:
    # Constraints (> 0 violates): instability and not fitting are what TPE must learn to avoid.
    trial.set_constraint("unstable", 0.0 if measured.stable else 1.0)
    trial.set_constraint("infeasible", 0.0 if measured.feasible else 1.0)
    trial.set_user_attr(TRIAL_ATTR_RESULT, {**_measured_to(measured), "pruned": pruned})
    study.tell(trial, value)


def best_goodput(measured: dict[Candidate, Measured]) -> float:
    stable = [m.goodput for m in measured.values() if m.feasible and m.stable]
    return max(stable, default=0.0)


def _measured_to(m: Measured) -> dict[str, Any]:
    c = m.candidate
    return {
        "mode": c.mode, "micro_batch": c.micro_batch, "loss_scale": c.loss_scale, "init_scale": c.init_scale,
        "growth_interval": c.growth_interval, "goodput": m.goodput, "feasible": m.feasible, "stable": m.stable,
        "oom": m.oom, "outcome": m.outcome, "reason": m.reason[:2000], "verdict_kind": m.verdict_kind,
    }


def _measured_from(data: dict[str, Any]) -> Measured:
    cand = Candidate(data["mode"], data.get("micro_batch"), data.get("loss_scale"), data.get("init_scale"), data.get("growth_interval"))
    return Measured(
        cand, float(data["goodput"]), bool(data["feasible"]), bool(data["stable"]), bool(data.get("oom", False)),
        str(data.get("outcome", "")), str(data.get("reason", "")), str(data.get("verdict_kind", "")),
    )
