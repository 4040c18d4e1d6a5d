"""The search over precision mode, loss scaling and micro-batch size: Optuna's ask and tell.
Unstable and out-of-memory candidates are told as constraint violations, which TPE learns from,
not as failures, which it ignores; in a shared study a worker runs nothing another has run or runs.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from advisor._log import get_logger
from advisor.tune._options import TuneOptions
from advisor.tune._space import (
    FP16_GROWTH_INTERVALS,
    FP16_INIT_SCALES,
    SPLIT_KEEPS,
    Candidate,
    Measured,
    SearchSpace,
    SpaceLimits,
    preference_key,
    scales_loss,
    upper_bound,
)
from advisor.tune._storage import (
    MAX_RETRY_ENV,
    StorageLost,
    Worker,
    lost_message,
    root_line,
    shared_storage,
    storage_error,
)
from advisor.tune._study import (
    STUDY_ATTR_REPLICATE,
    ask,
    beating,
    check_hardware,
    claim,
    claim_space,
    claim_workload,
    close,
    fail_stale,
    open_study,
    read_trials,
    refused,
    store_result,
    tell,
)
from probes import MpadviseError

MAX_DUPLICATE_PROPOSALS = 3
# How often a worker with nothing left but candidates others are running looks again (seconds;
# never longer than the heartbeat interval, so a silent worker's trial is taken up promptly).
WAIT_POLL_S = 5.0


@dataclass
class SearchOutcome:
    """What the search ran and why it stopped."""

    measured: dict[Candidate, Measured] = field(default_factory=dict)
    # Proposals the priors ruled out, never run (here or in the resumed study), with the reason.
    pruned: dict[Candidate, str] = field(default_factory=dict)
    runs: int = 0  # trials actually run in this invocation (resumed ones are not counted)
    resumed: int = 0  # results taken from the study: an earlier run's, or another worker's
    stop_reason: str = ""


def loss_scale_choices(limits: SpaceLimits) -> tuple[list[str], list[float], list[int]]:
    """The loss scale kinds, initial scales and growth intervals the search offers (GradScaler's
    defaults alone where the settings cannot be applied, as in the HF Trainer)."""
    settings = limits.loss_scale_settings
    return ([k for k in ("dynamic", "static") if k in limits.loss_scale_kinds],
            list(FP16_INIT_SCALES) if settings else [65536.0], list(FP16_GROWTH_INTERVALS) if settings else [2000])


def _suggest(trial: Any, space: SearchSpace) -> Candidate:
    mode = trial.suggest_categorical("mode", list(space.modes))
    micro = trial.suggest_categorical("micro_batch", list(space.micro_batches)) if space.micro_batches else None
    # Under FSDP2, a 16-bit mode's gradients may be reduced in fp32 or in its own dtype.
    reduce_options = space.reduce_options(mode)
    reduce = space.reduce_dtype(mode, trial.suggest_categorical("reduce_dtype", reduce_options)) if reduce_options else None
    if not scales_loss(mode):
        return space.normalise(Candidate(mode, micro, reduce_dtype=reduce))
    kinds, inits, growths = loss_scale_choices(space.limits)
    kind = trial.suggest_categorical("loss_scale", kinds)
    init = trial.suggest_categorical("init_scale", inits)
    growth = trial.suggest_categorical("growth_interval", growths) if kind == "dynamic" else None
    return space.normalise(Candidate(mode, micro, kind, init, growth, reduce))


def run_search(
    space: SearchSpace, evaluate: Callable[[Candidate], Measured], options: TuneOptions, *, first: list[Candidate],
    reference_goodput: float, dtype_ratio: dict[str, float], study_name: str = "mpadvise",
    known: dict[Candidate, Measured] | None = None, clock: Callable[[], float] = time.monotonic,
    replicate: dict[str, Any] | None = None, hardware: str | None = None,
    sleep: Callable[[float], None] = time.sleep, workload: Mapping[str, Any] | None = None,
) -> SearchOutcome:
    """Search ``space`` for the fastest stable candidate: ``first`` are enqueued before the
    sampler takes over (only by the worker that made a shared study); ``known`` are measured
    already (the reference); ``replicate``, ``hardware`` and ``workload`` go with the study."""
    start = clock()
    outcome = SearchOutcome(dict(known or {}))
    worker = Worker.of(options.storage, sleep)
    shared = shared_storage(options.storage)
    study = None
    try:  # the tune opened this storage before its reference ran: unreachable now is an outage
        study, made = worker.call("opening the study", lambda: open_study(
            options.storage, study_name, resume=options.resume, seed=options.seed, worker=worker.name))
        # Every call on the study goes through worker.call, so that an outage at any of them is
        # ridden out; each is safe to repeat (a write that landed before its answer was lost).
        if made:  # at once, so that workers joining in a moment find the first candidates queued
            worker.call("queueing the first candidates", lambda: _enqueue_first(study, space, first))
        worker.call("checking the study's hardware", lambda: check_hardware(study, study_name, hardware, record=True))
        worker.call("checking the study's search space", lambda: claim_space(study, space, study_name, shared=shared))
        worker.call("checking the study's workload",
                    lambda: claim_workload(study, study_name, workload, shared=shared))
        if replicate is not None:
            worker.call("storing fp32's replicate", lambda: study.set_user_attr(STUDY_ATTR_REPLICATE, replicate))
        if not made and not shared:  # a resumed study of this machine
            worker.call("queueing the first candidates", lambda: _enqueue_first(study, space, first))
        priors = _Priors(space, reference_goodput, dtype_ratio, enabled=not options.no_priors)
        _Search(study, space, evaluate, options, priors, outcome, worker, dict(known or {}),
                lambda: clock() - start).loop()
    except StorageLost as exc:  # the server stayed away through the retries
        lost = lost_message(options.storage, str(exc), worker, outcome.runs, retried=worker.retry_s)
        raise MpadviseError(lost) from None
    except MpadviseError:
        raise
    except Exception as exc:
        if study is None:  # a locked file, a refusal
            raise MpadviseError(storage_error(options.storage or ":memory:", exc)) from None
        if not refused(exc):
            raise
        # Refused, not unreachable.
        raise MpadviseError(lost_message(options.storage, root_line(exc), worker, outcome.runs, retried=None)) from None
    outcome.pruned = {c: why for c, why in outcome.pruned.items() if c not in outcome.measured}
    return outcome


@dataclass
class _Search:
    """One worker's search loop on an open study."""

    study: Any
    space: SearchSpace
    evaluate: Callable[[Candidate], Measured]
    options: TuneOptions
    priors: _Priors
    outcome: SearchOutcome
    worker: Worker
    reference: dict[Candidate, Measured]  # measured outside the study (fp32), until told
    elapsed: Callable[[], float]
    grid: list[Candidate] = field(init=False)

    def __post_init__(self) -> None:
        self.grid = self.space.grid()

    def untried(self) -> list[Candidate]:
        return [c for c in self.grid if c not in self.outcome.measured]

    def loop(self) -> None:
        study, outcome, worker, priors, options = self.study, self.outcome, self.worker, self.priors, self.options
        duplicates = 0
        announced: set[int] = set()
        while True:
            worker.call("failing the trials of silent workers", lambda: fail_stale(study))
            claimed = self.take_in()
            untried = self.untried()
            promising = priors.promising(untried, outcome.measured)
            if outcome.runs >= options.trials:
                outcome.stop_reason = f"trial budget reached ({options.trials} trials)"
            elif options.time_budget is not None and self.elapsed() >= options.time_budget:
                outcome.stop_reason = f"time budget reached ({options.time_budget:g} s)"
            elif not untried:
                outcome.stop_reason = f"every candidate of the space was measured ({len(self.grid)})"
            elif not promising:
                outcome.stop_reason = (f"no untried candidate can beat the best ({len(untried)} left; bounded by the "
                                       "measured matmul ratios, memory fit and measured variants)")
            if outcome.stop_reason:
                return
            if all(c in claimed for c in promising):
                # What is left runs on other workers: wait for their results, or for a silent
                # worker's trial to come back to the queue.
                announced = _wait(claimed, promising, announced, worker)
                continue
            trial = worker.call("asking the study for a trial", lambda: ask(study))
            with beating(worker, trial):
                done = self.propose(trial)
            if done == "ran":
                duplicates = 0
                continue
            duplicates += 1
            # The sampler keeps proposing what is known, or proposed what another worker runs (its
            # first proposals are random draws): queue the most promising free candidate instead.
            if duplicates >= MAX_DUPLICATE_PROPOSALS or done == "taken":
                claimed = self.take_in()
                free = [c for c in priors.promising(self.untried(), outcome.measured) if c not in claimed]
                if free:
                    params = _params(self.space, priors.most_promising(free, outcome.measured))
                    worker.call("queueing a trial", lambda params=params: study.enqueue_trial(params))
                duplicates = 0

    def propose(self, trial: Any) -> str:
        """Claim the trial's candidate and run it (``"ran"``), tell it unrun when measured or pruned
        (``"told"``), or close it when another worker runs it (``"taken"``)."""
        worker, outcome = self.worker, self.outcome
        # Optuna writes each suggested parameter to the study; a retry keeps the ones that landed.
        candidate = worker.call(f"reading trial {trial.number}'s candidate", lambda: _suggest(trial, self.space))
        # The claim is written before the look at the others: of two workers that propose one
        # candidate at once, the later look sees the earlier claim, so both never run it.
        worker.call(f"claiming trial {trial.number}", lambda: claim(trial, candidate, worker.name))
        claimed = self.take_in(exclude=trial.number)
        promising = self.priors.promising(self.untried(), outcome.measured)
        if candidate in outcome.measured or candidate not in promising:
            worker.call(f"telling trial {trial.number}", lambda: self.tell_without_running(trial, candidate))
            return "told"
        if candidate in claimed:
            why = f"not run: trial {claimed[candidate]} of another worker runs {candidate.label}"
            worker.call(f"closing trial {trial.number}", lambda: close(self.study, trial, why))
            return "taken"
        self.run_trial(trial, candidate)
        return "ran"

    def take_in(self, *, exclude: int | None = None) -> dict[Candidate, int]:
        """Take in what the study's finished trials measured (a candidate's first result counts);
        returns the candidates other trials run now, with their numbers. One whose trials lost their
        workers more often than they are retried is given up as a crash."""
        outcome, heartbeat = self.outcome, self.worker.heartbeat
        trials = self.worker.call("reading the study", lambda: read_trials(self.study, exclude=exclude))
        for m in trials.pruned:
            outcome.pruned.setdefault(m.candidate, m.reason or "not run: the priors ruled it out")
        for m in trials.measured:
            if m.candidate not in outcome.measured:
                outcome.resumed += 1
                outcome.measured[m.candidate] = m
        for cand, numbers in trials.silent.items():
            if (heartbeat is not None and len(numbers) > heartbeat.max_retry and cand not in outcome.measured
                    and cand not in trials.running):
                outcome.measured[cand] = Measured(
                    cand, 0.0, feasible=False, stable=False, outcome="crash",
                    reason=(f"not run again: its trials {', '.join(map(str, numbers))} lost their workers (no "
                            f"heartbeat for {heartbeat.grace_s} s), more often than the {heartbeat.max_retry} "
                            f"retries ({MAX_RETRY_ENV})"))
        return trials.running

    def tell_without_running(self, trial: Any, candidate: Candidate) -> None:
        """Tell the sampler what is known of a proposal, unrun: a pruned one as infeasible, this
        worker's reference as such, other results as copies."""
        known = self.outcome.measured.get(candidate)
        if known is not None:
            source = "reference" if candidate in self.reference else "known"
            tell(self.study, trial, known, source=source, worker=self.worker.name)
            self.reference.pop(candidate, None)
            return
        reason = self.outcome.pruned[candidate] = self.priors.why_pruned(candidate, self.outcome.measured)
        tell(self.study, trial, Measured(candidate, 0.0, feasible=False, stable=False, outcome="pruned", reason=reason),
             source="pruned", worker=self.worker.name)

    def run_trial(self, trial: Any, candidate: Candidate) -> None:
        worker = self.worker
        try:
            measured = self.evaluate(candidate)
        except BaseException:
            # Interrupted (Ctrl-C), or the runner failed: close the trial so that no worker waits
            # for it; the candidate stays untried, for --resume or another worker.
            with contextlib.suppress(Exception):
                close(self.study, trial, f"not finished: {worker.name} stopped while running it")
            raise
        self.outcome.runs += 1
        self.outcome.measured[candidate] = measured
        # Kept here until the study has it: a storage that is away now may be back before it is needed.
        worker.untold[trial.number] = measured
        what = f"storing trial {trial.number}'s result ({candidate.label})"
        if store_result(self.study, trial, measured, worker, what):
            # Failed as stale by another worker while this one ran it (or while the storage was away):
            # the result landed as a trial of its own, so that the queued copy is told, not run again.
            grace = worker.heartbeat.grace_s if worker.heartbeat else 0
            get_logger().warning(
                f"trial {trial.number} ({candidate.label}) was failed by another worker while it ran here (no "
                f"heartbeat reached the study for {grace} s): its result is stored as a new trial")
        worker.untold.pop(trial.number, None)


def _wait(claimed: dict[Candidate, int], promising: list[Candidate], announced: set[int], worker: Worker) -> set[int]:
    """Wait a while for the trials other workers run, saying so once for each new set of them."""
    waiting = {c: claimed[c] for c in promising if c in claimed}
    numbers = set(waiting.values())
    if not numbers <= announced:
        listed = ", ".join(f"{n} ({c.label})" for c, n in sorted(waiting.items(), key=lambda item: item[1]))
        after = f"; a trial whose worker goes silent runs again after {worker.heartbeat.grace_s} s" if worker.heartbeat else ""
        get_logger().info(f"waiting for the trials other workers are running: {listed}{after}")
    worker.sleep(WAIT_POLL_S if worker.heartbeat is None else min(WAIT_POLL_S, float(worker.heartbeat.interval_s)))
    return announced | numbers


@dataclass(frozen=True)
class _Priors:
    """Upper bounds on what untried candidates could reach (every one promising unless ``enabled``)."""

    space: SearchSpace
    reference_goodput: float
    dtype_ratio: dict[str, float]
    enabled: bool

    def bound(self, candidate: Candidate, measured: dict[Candidate, Measured]) -> float:
        return upper_bound(candidate, measured, user_batch=self.space.user_batch,
                           reference_goodput=self.reference_goodput, dtype_ratio=self.dtype_ratio)

    def promising(self, untried: list[Candidate], measured: dict[Candidate, Measured]) -> list[Candidate]:
        if not self.enabled:
            return untried
        best = best_goodput(measured)
        return [c for c in untried if self.bound(c, measured) > best]

    def why_pruned(self, candidate: Candidate, measured: dict[Candidate, Measured]) -> str:
        bound, best = self.bound(candidate, measured), best_goodput(measured)
        if bound <= 0:
            return ("not run: it cannot fit or stay stable (out of memory at a micro-batch no larger, or a "
                    f"micro-batch split of settings that failed as {' or '.join(sorted(SPLIT_KEEPS))}, which a "
                    "split cannot cure); --no-priors runs it")
        return (f"not run: the priors bound it at {bound:,.0f} samples/s (matmul ratio, measured variants), no "
                f"more than the best measured {best:,.0f}/s; --no-priors runs it")

    def most_promising(self, promising: list[Candidate], measured: dict[Candidate, Measured]) -> Candidate:
        return max(promising, key=lambda c: (self.bound(c, measured) if self.enabled else 0.0,
                                             [-x for x in preference_key(c, self.space.user_batch)]))


def _enqueue_first(study: Any, space: SearchSpace, first: list[Candidate]) -> None:
    done_params = [t.params for t in study.get_trials(deepcopy=False)]
    for cand in first:
        params = _params(space, space.normalise(cand))
        if params not in done_params:
            study.enqueue_trial(params, skip_if_exists=True)


def _params(space: SearchSpace, candidate: Candidate) -> dict[str, object]:
    """The Optuna parameters that select ``candidate``, the micro-batch always named (the sampler
    draws a parameter an enqueued trial leaves out)."""
    params = candidate.params()
    if space.micro_batches and "micro_batch" not in params:
        params["micro_batch"] = space.user_batch
    return params


def best_goodput(measured: dict[Candidate, Measured]) -> float:
    return max((m.goodput for m in measured.values() if m.feasible and m.stable), default=0.0)
