"""The tune, composed of its five stages: plan, run, judge, confirm, answer.

``tune_policy`` only composes them: the run stage's trial book (``Trials``) runs the fp32
reference and its replicate, and every search trial, each judged against fp32; ``plan`` draws
the space and its priors; the search (``run_search``) proposes candidates to run; ``confirm``
re-measures the close finalists side by side; ``answer`` picks the winner and its one speed-up
figure. Timing noise lives behind one ``Timing`` strategy (``advisor.tune._steady``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from advisor.trial import TrialResult
from advisor.tune._answer import Speedup, TuneCost, TuneResult, answer
from advisor.tune._confirm import LOCAL_PAIRS, Finalist, confirm
from advisor.tune._judge import Evaluation
from advisor.tune._options import TuneOptions
from advisor.tune._plan import measure_matmul, plan
from advisor.tune._search import run_search
from advisor.tune._space import Measured, SpaceLimits
from advisor.tune._stability import StabilityThresholds
from advisor.tune._steady import (
    REMEASURE_LEANING_ROUNDS,
    REMEASURE_MAX_ROUNDS,
    SteadyRunner,
    Timing,
    timing_for,
)
from advisor.tune._study_status import check_study_workload, stored_replicate
from advisor.tune._trials import Runner, Trials
from policies import Policy
from probes import HardwareProfile, hardware_fingerprint

__all__ = ["LOCAL_PAIRS", "REMEASURE_LEANING_ROUNDS", "REMEASURE_MAX_ROUNDS", "Finalist", "Speedup", "TuneCost",
           "TuneResult", "measure_matmul", "tune_policy"]


def tune_policy(
    runner: Runner,
    profile: HardwareProfile,
    options: TuneOptions | None = None,
    *,
    study_name: str = "mpadvise",
    thresholds: StabilityThresholds | None = None,
    dtype_ratio: dict[str, float] | None = None,
    peak_tflops: dict[str, float] | None = None,
    remeasure: bool = True,
    workload: dict[str, Any] | None = None,
    on_start: Callable[[str], None] | None = None,
    on_done: Callable[[str, Evaluation | None, Measured], None] | None = None,
    clock: Callable[[], float] | None = None,
    limits: SpaceLimits | None = None,
    on_round: Callable[[int, int, int], None] | None = None,
    timing: Timing | None = None,
) -> TuneResult:
    """Find the fastest stable policy for the workload that ``runner`` runs.

    Args:
        runner: runs one candidate Policy (subprocess script trials, or a function in-process);
            one that can perturb fp32's initial weights (``Perturbable``) also runs fp32's
            replicate, whose drift widens the stability limits.
        profile: the hardware the trials run on; decides the search space and the timing.
        options: the tune's options (defaults when ``None``). The tuner reads ``trials``
            (the reference and re-measurements not counted), ``time_budget`` (no trial of the
            search and no round of re-measurement starts after it), ``scale_batch``,
            ``include_emulated``, ``modes``, ``memory_limit`` (candidates over it are
            infeasible), ``storage`` and ``resume`` (where the Optuna study lives; a study of
            another workload is not resumed), ``seed`` (of the sampler) and ``no_priors``; the
            runner has the measuring window already.
        study_name: the study's name in that storage.
        thresholds: stability thresholds.
        dtype_ratio: matmul ratios per dtype; measured on the device when ``None``.
        peak_tflops: matmul TFLOP/s per dtype, each candidate's MFU's denominator (``plan``).
        remeasure: re-measure close candidates interleaved, and the winner against fp32 for
            its speed-up, before declaring a winner.
        workload: extra facts recorded in the winner's ``[tuned_on]`` (script name).
        on_start, on_done: progress callbacks.
        clock: monotonic seconds (tests pass a fake).
        limits: what the script's way of training can apply (a framework's limits).
        on_round: called before each round of re-measurement with its number (from 1), the
            most rounds there can be, and how many runs it holds.
        timing: the timing strategy; the device's (``timing_for``) when ``None``.

    Raises:
        MpadviseError: the fp32 reference failed, so nothing can be judged.
    """
    options = options or TuneOptions()
    clock = clock or time.monotonic
    start = clock()
    timing = timing or timing_for(profile)
    # Every trial, the reference's first, is run again when the machine disturbed or lost it.
    trials = Trials(SteadyRunner(runner, timing.watch), thresholds or StabilityThresholds(),
                    options.memory_limit_bytes, on_start, on_done)
    fp32 = trials.run_reference(deadline=None if options.time_budget is None else start + options.time_budget,
                                clock=clock).result
    planned = plan(profile, options, fp32, limits=limits, dtype_ratio=dtype_ratio, peak_tflops=peak_tflops)
    ref_measured = trials.record(planned.ref_cand, Policy(mode="fp32"), fp32)
    # A stored study's verdicts hold for the workload its reference ran: one whose model,
    # optimizer or batch changed since (an environment variable, a config file) starts afresh.
    workload_facts = _workload_facts(fp32)
    resume = check_study_workload(options.storage, study_name, workload_facts, resume=options.resume)
    if resume != options.resume:
        options = options.with_(resume=resume)
    # fp32's replicate, kept with a stored study (which --resume reuses): its drift calibrates
    # every verdict from here on.
    reference = trials.run_replicate(stored_replicate(options.storage, study_name) if options.resume else None)
    search_start = clock()
    search = run_search(
        planned.space, trials.run, options, first=planned.first, reference_goodput=reference.goodput or 0.0,
        dtype_ratio=planned.ratios, study_name=study_name, known={planned.ref_cand: ref_measured}, clock=clock,
        replicate=trials.replicate_record, hardware=hardware_fingerprint(profile), workload=workload_facts,
    )

    def out_of_time() -> bool:  # the search's budget bounds re-measurement too
        return options.time_budget is not None and clock() - search_start >= options.time_budget

    confirmed = confirm(trials, search.measured, trials.user_batch, planned.ref_cand, timing, remeasure=remeasure,
                        out_of_time=out_of_time, on_round=on_round)
    peaks = planned.final_peaks(profile, fp32)
    answered = answer(confirmed, trials, planned.ref_cand, reference.goodput or 0.0, profile, workload,
                      search.runs + search.resumed)
    return TuneResult(
        reference, planned.space, search, trials.evaluations, confirmed.finalists, answered.winner, answered.policy,
        answered.tie_note, answered.scale_batch_note, planned.ratios, clock() - start,
        dropped=confirmed.dropped, remeasure_rounds=confirmed.rounds, replicate=trials.replicate,
        speedup=answered.speedup, remeasure_stop=confirmed.stop, time_budget=options.time_budget,
        reference_rounds=list(confirmed.companion.rounds) if confirmed.companion else [],
        window_note=trials.window_note, measure_steps=getattr(trials.runner, "measure_steps", None),
        extended=list(trials.yardsticks.extended) if trials.yardsticks else [],
        disturbances=list(timing.watch.events), peak_tflops=peaks,
        cost=TuneCost.of(timing.watch.ran, clock() - start, fp32),
        round_bounds=(getattr(timing, "max_rounds", REMEASURE_MAX_ROUNDS),
                      getattr(timing, "leaning_rounds", REMEASURE_LEANING_ROUNDS)),
    )


def _workload_facts(result: TrialResult) -> dict[str, str | None]:
    """What identifies the workload a reference trial ran, for the study to keep."""
    return {"workload_fingerprint": result.workload_fingerprint, "model_signature": result.model_signature}
