"""The tune, composed of its five stages: plan, run, judge, confirm, answer."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from advisor.tune._answer import TuneCost, TuneResult, answer
from advisor.tune._confirm import LOCAL_PAIRS, confirm
from advisor.tune._judge import Evaluation
from advisor.tune._options import TuneOptions
from advisor.tune._plan import measure_matmul, plan
from advisor.tune._run import Runner
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
from advisor.tune._trials import Trials
from policies import Policy
from probes import HardwareProfile, hardware_fingerprint

__all__ = ["LOCAL_PAIRS", "REMEASURE_LEANING_ROUNDS", "REMEASURE_MAX_ROUNDS", "TuneCost",
           "TuneResult", "measure_matmul", "tune_policy"]


def tune_policy(
    runner: Runner, profile: HardwareProfile, options: TuneOptions | None = None, *, study_name: str = "mpadvise",
    thresholds: StabilityThresholds | None = None, dtype_ratio: dict[str, float] | None = None,
    peak_tflops: dict[str, float] | None = None, remeasure: bool = True, workload: dict[str, Any] | None = None,
    on_start: Callable[[str], None] | None = None,
    on_done: Callable[[str, Evaluation | None, Measured], None] | None = None,
    clock: Callable[[], float] | None = None, limits: SpaceLimits | None = None,
    on_round: Callable[[int, int, int], None] | None = None, timing: Timing | None = None,
    late: Mapping[str, str] | None = None,
) -> TuneResult:
    """Find the fastest stable policy for the workload ``runner`` runs (MpadviseError when the
    fp32 reference fails). ``late`` maps the modes a long run's guard found unstable to their
    verdict: they are not run, and a stored study's runs of them lose."""
    options = options or TuneOptions()
    clock = clock or time.monotonic
    start = clock()
    timing = timing or timing_for(profile)
    # Every trial, the reference's first, is run again when the machine disturbed or lost it.
    trials = Trials(SteadyRunner(runner, timing.watch), thresholds or StabilityThresholds(),
                    options.memory_limit_bytes, on_start, on_done)
    fp32 = trials.run_reference(deadline=None if options.time_budget is None else start + options.time_budget,
                                clock=clock).result
    late = dict(late or {})
    planned = plan(profile, options, fp32, limits=limits, dtype_ratio=dtype_ratio, peak_tflops=peak_tflops,
                   late=late)
    ref_measured = trials.record(planned.ref_cand, Policy(mode="fp32"), fp32)
    # A stored study's verdicts hold for the workload its reference ran: one whose model,
    # optimizer or batch changed since (an environment variable, a config file) starts afresh.
    workload_facts = {"workload_fingerprint": fp32.workload_fingerprint, "model_signature": fp32.model_signature}
    options = options.with_(resume=check_study_workload(options.storage, study_name, workload_facts,
                                                        resume=options.resume))
    # fp32's replicate (a resumed study's, reused): its drift calibrates every verdict from here on.
    reference = trials.run_replicate(stored_replicate(options.storage, study_name) if options.resume else None)
    search_start = clock()
    search = run_search(
        planned.space, trials.run, options, first=planned.first, reference_goodput=reference.goodput or 0.0,
        dtype_ratio=planned.ratios, study_name=study_name, known={planned.ref_cand: ref_measured}, clock=clock,
        replicate=trials.replicate_record, hardware=hardware_fingerprint(profile), workload=workload_facts,
    )

    for cand, m in list(search.measured.items()):  # a resumed study's runs of a mode found unstable late
        if cand.mode in late:
            search.measured[cand] = replace(m, stable=False, outcome="unstable", reason=late[cand.mode],
                                            verdict_kind="late")

    def out_of_time() -> bool:  # the search's budget bounds re-measurement too
        return options.time_budget is not None and clock() - search_start >= options.time_budget

    confirmed = confirm(trials, search.measured, trials.user_batch, planned.ref_cand, timing, remeasure=remeasure,
                        out_of_time=out_of_time, on_round=on_round)
    peaks = planned.final_peaks(profile, fp32)
    return answer(confirmed, trials, planned, search, reference, profile, timing, workload=workload,
                  peaks=peaks, time_budget=options.time_budget, late=late, wall_s=clock() - start)
