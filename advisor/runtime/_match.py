"""Whether a tuned policy fits its workload: ``setup()`` checks the model, optimizer and script,
``micro_batch_size()`` the global batch. A miss applies another tune's answer for this workload,
else ``safe_fallback`` (``_switch``)."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from advisor import _paths
from advisor._log import get_logger
from advisor.runtime._split import BatchSplit, batch_split, tuned_global_batch
from advisor.runtime._switch import fall_back, switch_to
from advisor.runtime._workload import (
    GLOBAL_BATCH,
    Workload,
    WorkloadMismatch,
    current_world_size,
    workload_mismatch,
)
from policies import Difference, Policy

if TYPE_CHECKING:
    import torch

    from advisor.runtime._applied import AppliedPolicy

SCRIPT_ARGS = "script arguments"  # the fact a Difference names for other arguments than tuned


@dataclass
class WorkloadCheck:
    """What an ``AppliedPolicy`` knows of its workload, and where its check stands."""

    match_workload: bool
    alternatives: list[tuple[Policy, str]]
    user_batch: int | None = None
    other_batches: set[int] = field(default_factory=set)
    split: BatchSplit | None = None
    workload: Workload | None = None
    mismatch_reported: bool = False


def check_setup(applied: AppliedPolicy, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Fingerprint ``model`` before any mode swaps its modules, and replace a policy that does not fit."""
    check = applied._check
    check.workload = Workload.of(model, optimizer, global_batch=None,
                                 script=_paths.current_script(), args=_script_args())
    applied.model_signature = check.workload.model
    mismatch = setup_mismatch(applied, applied.policy)
    if mismatch is not None and not apply_other_answer(applied, mismatch, lambda policy: setup_mismatch(applied, policy)):
        # The answer was measured on another workload: its mode may be unstable or slow for
        # this one. Switch before setup() converts the model, which is what the mode changes.
        fall_back(applied, mismatch.reason(), _args_now(mismatch))


def first_micro_batch(applied: AppliedPolicy, default: int) -> int:
    """``micro_batch_size(default)``'s first call: check the policy at this batch, then split it."""
    check = applied._check
    check.user_batch = default
    mismatch = batch_mismatch(applied, applied.policy, default)
    if mismatch is not None and applied.model is None:
        # Before setup(): another tune's answer at this batch may fit; setup() checks the rest.
        if apply_other_answer(applied, mismatch, lambda policy: batch_mismatch(applied, policy, default)):
            mismatch = None
    if mismatch is not None and not applied._converted:
        fall_back(applied, mismatch.reason(), _args_now(mismatch))
        mismatch = None
    split = check.split = batch_split(applied.policy, default)
    if mismatch is not None:
        # A cached answer whose mode already converted the model in setup(): the model
        # cannot be taken back, so the mode stays, on the script's own global batch.
        check.mismatch_reported = True
        get_logger().warning(
            f"{mismatch.reason()}; keeping {applied.policy.mode} from {applied.source}, since setup() already "
            f"converted the model for it, with the global batch {default} "
            f"({split.describe()}); run `mpadvise tune` again"
        )
    elif split.note:
        (get_logger().warning if split.warning else get_logger().info)(split.note)
    return split.micro


def later_micro_batch(check: WorkloadCheck, default: int, split: BatchSplit) -> int:
    """``micro_batch_size(default)`` again: the same micro-batch, or ``default`` for another loader."""
    if default == check.user_batch:
        return split.micro
    if default not in check.other_batches:
        check.other_batches.add(default)
        get_logger().info(
            f"micro_batch_size({default}) after micro_batch_size({check.user_batch}): the first call set the "
            f"training batch ({split.describe()}); {default} is returned unchanged, as for an "
            "evaluation loader"
        )
    return default


def setup_mismatch(applied: AppliedPolicy, policy: Policy) -> WorkloadMismatch | None:
    """What changed since ``policy`` was tuned, as far as ``setup()`` can tell."""
    tuned, check = policy.tuned_on, applied._check
    # The first model set up is the one trained; a later setup() (a teacher, an EMA copy)
    # cannot switch the mode of the first.
    if tuned is None or check.workload is None or check.mismatch_reported or applied.model is not None:
        return None
    # Until micro_batch_size() says which global batch the script trains at, take the
    # tuned one here: micro_batch_size() compares it.
    batch = check.user_batch if check.user_batch is not None else tuned.global_batch
    here = replace(check.workload, global_batch=_on_every_process(applied, batch))
    mismatch = workload_mismatch(tuned, here, model_only=not check.match_workload)
    if mismatch is None or not check.match_workload or tuned.args is None or tuned.args == here.args:
        return mismatch
    # The tune recorded its arguments: name both lists, and judge the rest of the workload
    # as if the arguments were the tuned ones, so what else changed is named too.
    rest = workload_mismatch(tuned, replace(here, args=tuned.args))
    return _with_args(rest, tuned.args, here.args)


def grad_accum_steps(applied: AppliedPolicy) -> int:
    """Micro-batches per optimizer step (1 unless the policy splits the script's batch)."""
    split = applied._check.split
    return split.accum if split is not None else applied.policy.grad_accum_steps or 1


def world_size(applied: AppliedPolicy) -> int:
    """How many processes train together: as ``setup()`` found it, else as now."""
    workload = applied._check.workload
    return workload.world_size if workload is not None else current_world_size()


def global_batch(applied: AppliedPolicy) -> int | None:
    """Samples per optimizer step over all processes, once ``micro_batch_size()`` was called."""
    split = applied._check.split
    return None if split is None else split.micro * split.accum * applied.world_size


def workload_fingerprint(applied: AppliedPolicy) -> str | None:
    """The cache key of this workload, once ``setup()`` was called."""
    check = applied._check
    if check.workload is None:
        return None
    return replace(check.workload, global_batch=_on_every_process(applied, check.user_batch)).fingerprint()


def _on_every_process(applied: AppliedPolicy, per_process: int | None) -> int | None:
    return None if per_process is None else per_process * applied.world_size


def batch_mismatch(applied: AppliedPolicy, policy: Policy, batch: int) -> WorkloadMismatch | None:
    """A tune's answer tuned at another global batch than the script's ``batch``."""
    check = applied._check
    tuned_batch = tuned_global_batch(policy)
    if not check.match_workload or check.mismatch_reported or tuned_batch in (None, batch):
        return None
    mismatch = WorkloadMismatch((Difference(GLOBAL_BATCH, str(tuned_batch), str(batch)),))
    # Before setup() the rest of the workload is unknown; the arguments are, where recorded.
    tuned_args, args = None if policy.tuned_on is None else policy.tuned_on.args, _script_args()
    if tuned_args is None or tuned_args == args:
        return mismatch
    return _with_args(mismatch, tuned_args, args)


def apply_other_answer(
    applied: AppliedPolicy, mismatch: WorkloadMismatch, mismatch_of: Callable[[Policy], WorkloadMismatch | None]
) -> bool:
    """Apply the first other answer that fits, with one info line; False when none does."""
    alternatives = applied._check.alternatives
    for index, (policy, source) in enumerate(alternatives):
        if mismatch_of(policy) is None:
            del alternatives[: index + 1]
            get_logger().info(
                f"using {policy.describe()} from {source}, tuned on this workload, rather than "
                f"{applied.policy.describe()} from {applied.source}, tuned on another ({mismatch.detail()})"
            )
            switch_to(applied, policy, source)
            return True
    alternatives.clear()
    return False


def _script_args() -> tuple[str, ...]:
    return tuple(sys.argv[1:]) if _paths.current_script() is not None else ()


def _with_args(mismatch: WorkloadMismatch | None, tuned: Sequence[str], here: Sequence[str]) -> WorkloadMismatch:
    """``mismatch`` (``None``: nothing else changed) with the arguments' difference recorded."""
    mismatch = WorkloadMismatch(()) if mismatch is None else mismatch
    args = Difference(SCRIPT_ARGS, shlex.join(tuned) or "(none)", shlex.join(here) or "(none)")
    unrecorded = tuple(name for name in mismatch.unrecorded if name != SCRIPT_ARGS)
    return replace(mismatch, differences=(*mismatch.differences, args), unrecorded=unrecorded,
                   args_now=tuple(here))


def _args_now(mismatch: WorkloadMismatch) -> tuple[str, ...] | None:
    return _script_args() if any(d.what == SCRIPT_ARGS for d in mismatch.differences) else None
