"""Inside a trial's child process: what ``load_policy()`` does when a candidate is injected, and
one trial run in this process (``run_in_process``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from advisor.runtime import AppliedPolicy
from policies import Policy, PolicyError, supported_modes
from probes import HardwareProfile, UnsupportedHere

from ._loop_recorder import TrialRecorder
from ._schema import EXIT_UNSUPPORTED, RANK_ENV, TRIAL_SPEC_ENV, Stage, TrialSpec, rank_result_path
from ._seeding import seed_everything
from ._stacks import register_stack_dump
from ._step_window import ResultWriter, TrialComplete, end_trial_process, install_excepthook
from ._timeline import clear as clear_marks

_CHILD_APPLIED: AppliedPolicy | None = None


def spec_from_env() -> TrialSpec | None:
    """The trial spec injected into this process (a rank's, with its own result file), or None."""
    path = os.environ.get(TRIAL_SPEC_ENV)
    if not path:
        return None
    spec = TrialSpec.from_json(Path(path).read_text())
    if spec.nproc_per_node > 1:
        rank = os.environ.get(RANK_ENV, "0")
        spec = dataclasses.replace(spec, result_path=rank_result_path(spec.result_path, int(rank) if rank.isdigit() else 0))
    register_stack_dump(spec.result_path)
    return spec


def applied_for_trial(spec: TrialSpec, *, profile: HardwareProfile, device: str | None) -> AppliedPolicy:
    """The injected candidate applied, its recorder attached; unsupported: exit EXIT_UNSUPPORTED."""
    global _CHILD_APPLIED
    if _CHILD_APPLIED is not None:  # a script that calls load_policy() twice gets one recorder
        return _CHILD_APPLIED
    writer = ResultWriter(spec.result_path)
    writer.write(stage=Stage.LOADED, pid=os.getpid())
    install_excepthook(writer)
    applied = _build(spec, writer, profile=profile, device=device, in_process=False)
    if applied is None:
        end_trial_process(EXIT_UNSUPPORTED)
    _CHILD_APPLIED = applied
    return applied


def trial_candidate(spec: TrialSpec, writer: ResultWriter, *, profile: HardwareProfile,
                    refusal: Callable[[Policy], str | None] | None = None) -> Policy | None:
    """The injected candidate, or None (written ``unsupported``) when it, or ``refusal`` (a
    framework's limits, judged before the hardware's support), says it cannot run here."""
    try:
        policy = Policy.from_dict(spec.policy, source="trial spec")
    except PolicyError as exc:
        writer.write(stage=Stage.UNSUPPORTED, reason=str(exc))
        return None
    reason = refusal(policy) if refusal is not None else None
    if reason is None:
        # The policy's own support: an FP8 recipe the device cannot run stops here, before a trial.
        support = supported_modes(profile, policy)[policy.mode]
        if not support.supported:
            reason = f"{policy.mode} cannot run on {profile.name}: {support.reason}"
    if reason is not None:
        writer.write(stage=Stage.UNSUPPORTED, reason=reason)
        return None
    return policy


def _build(spec: TrialSpec, writer: ResultWriter, *, profile: HardwareProfile, device: str | None,
           in_process: bool) -> AppliedPolicy | None:
    policy = trial_candidate(spec, writer, profile=profile)
    if policy is None:
        return None
    seed_everything(spec.seed)
    recorder = TrialRecorder(spec, writer, in_process=in_process)
    applied = AppliedPolicy(policy, profile=profile, source=f"trial {spec.label or policy.mode}", device=device, observer=recorder)
    recorder.attach(applied)
    return applied


def run_in_process(train_fn: Any, spec: TrialSpec, *, profile: HardwareProfile) -> tuple[dict[str, Any], str | None]:
    """Run ``train_fn(mp)`` as one trial in this process: the result data, and any error text."""
    import gc
    import traceback

    # An earlier trial's model and data may still be held by reference cycles (the frames of
    # the exception that ended it): free them, or they count in this trial's memory.
    gc.collect()
    clear_marks()  # this process ran earlier trials: their marks are not this one's
    writer = ResultWriter(spec.result_path)
    writer.write(stage=Stage.LOADED)
    applied = _build(spec, writer, profile=profile, device=spec.device, in_process=True)
    if applied is None:
        return writer.data, None
    recorder = applied._observer
    assert isinstance(recorder, TrialRecorder)
    error = None
    try:
        train_fn(applied)
    except TrialComplete:
        pass
    except UnsupportedHere as exc:
        writer.write(stage=Stage.UNSUPPORTED, reason=str(exc))
    except Exception as exc:  # the trial's outcome, not ours: classify it
        writer.exception(exc)
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    else:
        if recorder.begun:
            recorder.finish(complete=False)
    finally:
        recorder.close()
    return writer.data, error
