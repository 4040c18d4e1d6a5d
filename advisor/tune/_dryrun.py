"""What a tune would do, without doing it: ``mpadvise tune --dry-run`` runs the checks a tune runs
before its first trial and describes the space and the plan; it starts no trial, makes no study
or storage file, and writes no config file or cache entry.
"""

from __future__ import annotations

import sys
from typing import Any

from advisor.tune._checks import check_modes, check_script
from advisor.tune._kept import StoredAnswer, answer_key, stored_answer
from advisor.tune._options import TuneOptions
from advisor.tune._service import (
    TuneRequest,
    _config_out,
    check_judgeable_window,
    default_storage_url,
    study_name_for,
)
from advisor.tune._space import (
    FP16_GROWTH_INTERVALS,
    FP16_INIT_SCALES,
    micro_batch_choices,
    scales_loss,
    space_for,
)
from advisor.tune._storage import shared_storage, shown_url
from advisor.tune._study_status import KeptStudy, check_storage, check_study, kept_study
from policies import check_config_target, mode_dtypes, supported_modes
from probes import HardwareProfile, hardware_fingerprint

# A batch with halves and quarters, to count the micro-batch sizes a search may try before the
# fp32 reference reads the script's own.
_SPLITTABLE_BATCH = 64


def tune_plan(request: TuneRequest, profile: HardwareProfile) -> dict[str, Any]:
    """The search space and the plan of a tune (JSON-ready), checked as the tune would check them.

    Raises:
        MpadviseError: what a real tune would refuse before its first trial (a stored study it
            would not delete unasked is reported in ``plan.study_action``, not raised).
    """
    path = check_script(request.script)
    options = request.options
    launch = request.launch
    modes = check_modes(list(options.modes), profile) if options.modes else []
    config_file = _config_out(options, path)
    check_config_target(config_file)
    check_judgeable_window(options)
    storage = options.storage if options.storage is not None else default_storage_url()
    if not storage.startswith("sqlite"):
        check_storage(storage)  # a server is only read; an SQLite file a tune would make is not made here
    fingerprint = hardware_fingerprint(profile)
    study_name = study_name_for(path, list(request.args), fingerprint, processes=options.nproc_per_node)
    held = kept_study(storage, study_name)
    if held is not None:  # a study it would continue must be of this hardware
        check_study(storage, study_name, hardware=fingerprint, resume=options.resume, fresh=True)
    support = supported_modes(profile)
    limits = launch.limits
    space = space_for(support, _SPLITTABLE_BATCH, include_emulated=options.include_emulated,
                      scale_batch=options.scale_batch, modes=modes or None, limits=limits)
    excluded = _excluded(support, space.modes, options, modes, launch)
    return {
        "dry_run": True,
        "script": str(path),
        "args": list(request.args),
        "hardware": {"name": profile.name, "fingerprint": fingerprint},
        "space": {
            "modes": list(space.modes),
            "excluded": excluded,
            "micro_batch": _micro_batch(options, launch),
            "loss_scale": _loss_scale(space.modes, limits),
            "candidates": len(space.grid()),
        },
        "plan": {
            "framework": launch.framework, "framework_detected": launch.detected, "trains_with": launch.label,
            "launch": [sys.executable, *launch.launch, str(path), *request.args],
            "processes_per_trial": options.nproc_per_node,
            "trials": options.trials, "reference_trials": 2, "steps": options.steps, "warmup": options.warmup,
            "time_budget_s": options.time_budget, "trial_timeout_s": options.timeout,
            "config_file": str(config_file), "cache": not options.no_cache,
            "study_name": study_name, "storage": shown_url(storage), "resume": options.resume,
            "study_action": _study_action(storage, held, options, _answered(storage, held, study_name, options,
                                                                            modes, launch, profile)),
        },
    }


def _excluded(support: dict[str, Any], searched: tuple[str, ...], options: TuneOptions, asked: list[str],
              launch: Any) -> dict[str, str]:
    dtypes = mode_dtypes()
    out = {}
    for mode, info in support.items():
        if mode in searched:
            continue
        if not info.supported:
            reason = info.reason or "not supported on this hardware"
            out[mode] = reason.removeprefix(f"{mode}: ")
        elif asked and mode not in asked:
            out[mode] = "not asked for (--mode)"
        elif dtypes.get(mode) == "fp8" and info.emulated and not options.include_emulated:
            out[mode] = "emulated here (no speed-up); --include-emulated searches it"
        else:
            why = launch.limits.why if launch.limits is not None and launch.limits.why else ""
            out[mode] = f"{launch.label} cannot apply it" + (f" ({why})" if why else "")
    return out


def _micro_batch(options: TuneOptions, launch: Any) -> str:
    if launch.limits is not None and not launch.limits.micro_batch:
        return f"the script's own batch only ({launch.label} cannot split it)"
    sizes = micro_batch_choices(_SPLITTABLE_BATCH, scale_batch=options.scale_batch)
    words = "the script's own batch (read by the fp32 reference), its half and quarter (accumulated back)"
    if options.scale_batch:
        words += ", its double and quadruple (--scale-batch changes the global batch)"
    return f"{words}: for a batch of {_SPLITTABLE_BATCH}, {', '.join(map(str, sizes))}"


def _loss_scale(modes: tuple[str, ...], limits: Any) -> dict[str, Any]:
    scaled = [mode for mode in modes if scales_loss(mode)]
    if not scaled:
        return {"modes": [], "kinds": [], "init_scales": [], "growth_intervals": []}
    settings = limits is None or limits.loss_scale_settings
    kinds = ["dynamic", "static"] if limits is None else [k for k in ("dynamic", "static") if k in limits.loss_scale_kinds]
    return {"modes": scaled, "kinds": kinds,
            "init_scales": list(FP16_INIT_SCALES) if settings else [65536.0],
            "growth_intervals": list(FP16_GROWTH_INTERVALS) if settings else [2000]}


def _answered(storage: str, held: KeptStudy | None, study_name: str, options: TuneOptions, modes: list[str],
              launch: Any, profile: HardwareProfile) -> StoredAnswer | None:
    """The answer kept that the tune would print again (the service's key); ``None`` where it would run."""
    if held is None or options.fresh or options.resume:
        return None
    resolved = options.with_(framework=launch.framework, modes=modes, storage=storage)
    return stored_answer(storage, study_name, answer_key(resolved, profile))


def _study_action(storage: str, held: KeptStudy | None, options: TuneOptions, answered: StoredAnswer | None) -> str:
    finished = 0 if held is None else held.finished
    if shared_storage(storage):
        return f"join the shared study ({finished} finished trials so far)" if held else "make the shared study"
    if options.resume:
        return f"continue the stored study ({finished} finished trials)" if held else "make the study (none to resume)"
    if finished and options.fresh:
        return f"delete the stored study's {finished} finished trials (--fresh) and start afresh"
    if answered is not None:
        return f"print the answer it kept, tuned {answered.at}, and run no trial (--fresh tunes again)"
    if finished:
        return (f"continue the stored study's {finished} finished trials (a tune interrupted, or tuned with other "
                "options): --fresh deletes them and starts afresh")
    return "make the study afresh"
