"""The plan stage: the search space, its priors and its bounds, once the fp32 reference has run."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import probes
from advisor.trial import TrialResult
from advisor.tune._checks import check_modes
from advisor.tune._options import TuneOptions
from advisor.tune._space import Candidate, SearchSpace, SpaceLimits, space_for
from advisor.tune._stability import safety_rank
from policies import safe_default_mode, supported_modes
from probes import HardwareProfile


@dataclass
class Plan:
    """What the tune will search, and what first (``first``: enqueued before the sampler explores).
    ``ratios``: matmul rates over fp32's; ``peaks`` in TFLOP/s; ``probed``: measured here."""

    space: SearchSpace
    ref_cand: Candidate
    first: list[Candidate]
    ratios: dict[str, float] = field(default_factory=dict)
    peaks: dict[str, float] = field(default_factory=dict)
    probed: bool = False

    def final_peaks(self, profile: HardwareProfile, reference: TrialResult) -> dict[str, float]:
        """Each dtype's higher figure of this plan's probe and one more at the tune's end: a
        neighbour's burst only slows a matmul, and two probes minutes apart rarely both meet one."""
        if not (self.probed and reference.flops_per_step):
            return self.peaks
        first, second = self.peaks, measure_matmul(profile)[1]
        return {dtype: max(first.get(dtype, 0.0), second.get(dtype, 0.0))
                for dtype in {**first, **second}}


def plan(profile: HardwareProfile, options: TuneOptions, reference: TrialResult, *,
         limits: SpaceLimits | None = None, dtype_ratio: dict[str, float] | None = None,
         peak_tflops: dict[str, float] | None = None, late: Mapping[str, str] | None = None) -> Plan:
    """The tune's plan once its fp32 ``reference`` has run; ``dtype_ratio`` (with ``peak_tflops``)
    is measured when ``None``; ``late``'s modes are not run."""
    user_batch = reference.user_batch
    support = supported_modes(profile)
    modes = check_modes(list(options.modes), profile) if options.modes else None  # unknown or unsupported: one clear error
    if late:
        modes = [m for m in (modes or support) if m not in late]
    space = space_for(support, user_batch, include_emulated=options.include_emulated,
                      scale_batch=options.scale_batch, modes=modes, limits=limits, fsdp=reference.fsdp)
    probed = False
    if dtype_ratio is not None:
        ratios, peaks = dtype_ratio, dict(peak_tflops or {})
    elif options.no_priors and not reference.flops_per_step:
        ratios, peaks = {}, {}  # neither priors nor an MFU to compute: the benchmark is not worth its seconds
    else:
        ratios, peaks = measure_matmul(profile)
        probed = True
        if options.no_priors:
            ratios = {}
    ref_cand = space.normalise(Candidate("fp32", user_batch))
    default_mode, _ = safe_default_mode(profile)
    # Every mode gets one honest look, safest first, before TPE explores variants.
    first = [ref_cand] + [space.normalise(Candidate(m, space.user_batch))
                          for m in sorted(space.modes, key=lambda m: (m != default_mode, safety_rank(m)))]
    return Plan(space, ref_cand, first, ratios, peaks, probed)


def late_unstable(events: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """The modes other than fp32 a long run found unstable after its trial's window, from the
    guard's events (newest first), each with its verdict."""
    late: dict[str, str] = {}
    for event in events:
        mode = str(event.get("policy") or "")
        if mode and mode != "fp32" and mode not in late:
            when = f" on {str(event['created_at'])[:10]}" if event.get("created_at") else ""
            late[mode] = (f"unstable late (step {event.get('step')}): the guard saw {event.get('signal')} under "
                          f"{mode} in a run{when}; mpadvise cache clear forgets it")
    return late


def measure_matmul(profile: HardwareProfile) -> tuple[dict[str, float], dict[str, float]]:
    """Matmul throughput per dtype on this device: relative to fp32 (the priors), and in TFLOP/s."""
    rows = [row for row in probes.matmul_benchmark(profile) if row.skipped is None]
    ratios = {row.dtype: float(row.ratio_vs_fp32) for row in rows if row.ratio_vs_fp32}
    peaks = {row.dtype: float(row.tflops) for row in rows if row.tflops}
    return {**ratios, "fp32": 1.0}, peaks
