"""The outcome of a finished trial, from its result file, exit status, stderr and stack dumps."""

from __future__ import annotations

import re
import signal
from collections.abc import Mapping, Sequence
from typing import Any

from ._schema import RESULT_FIELDS, Stage, TrialResult, TrialSpec, stage_text, unknown_result_fields
from ._stacks import stack_blame

SIGKILL = int(getattr(signal, "SIGKILL", 9))  # Windows has no SIGKILL; the number is never seen there


def classify(data: dict[str, Any] | None, *, exit_code: int | None, timed_out: bool, stderr_tail: str,
             spec: TrialSpec, timeout: float, wall_s: float = 0.0, oom_kills: int | None = None,
             timeline: Mapping[str, float] | None = None,
             stacks: Sequence[str | None] | None = None) -> TrialResult:
    """Decide the outcome of a finished child from its result file, exit code and stderr.

    A child that timed out, or died by a signal, before its candidate was applied is ``lost``
    (a tune runs it again). ``oom_kills``: the OOM kills in the child's memory cgroup while it
    ran, or ``None`` where unknown; a child ended by SIGKILL while it rose is out of memory.
    A DataLoader worker killed by SIGKILL is out of memory too unless the count was read and
    did not rise: nothing in a trial sends SIGKILL to a worker but the OOM killer."""
    unknown = unknown_result_fields(data or {})
    result_file: dict[str, Any] = {} if unknown else dict(data or {})
    stage = result_file.get("stage")
    exception = result_file.get("exception") or {}
    # What the TrialResult carries of the file; the rest (stage, exception...) only decides.
    base = {f.name: result_file[f.name] for f in RESULT_FIELDS if f.kept and f.name in result_file}
    base.update(exit_code=exit_code, stderr_tail=stderr_tail, policy=spec.policy, label=spec.label, wall_s=wall_s,
                timeline={**(result_file.get("timeline") or {}), **(timeline or {})},
                threads=spec.threads if spec.nproc_per_node == 1 else None)
    by_signal = exit_code is not None and exit_code < 0
    # Whether the candidate was applied: by the timeline, or by a stage only an applied one reaches.
    applied = ("policy_applied" in base["timeline"] or result_file.get("losses")
               or stage in (Stage.STEPPING, Stage.DONE, Stage.NO_STEP, Stage.UNSUPPORTED)
               or (stage == Stage.EXCEPTION and not exception.get("killed")))
    if unknown:
        outcome, reason = "crash", (
            f"the trial's result file holds unknown fields {unknown} (expected only those of "
            "advisor.trial.RESULT_FIELDS); the script ran under another version of mpadvise: "
            "run it with the same installation as the tune")
    elif (timed_out or by_signal) and not applied:
        outcome, reason = "lost", _lost_reason(
            None if exception.get("no_result") else stage, base["timeline"], spec, timed_out=timed_out, timeout=timeout, exit_code=exit_code, oom_kills=oom_kills,
            rank=exception.get("rank", result_file.get("rank_waiting")))
    elif timed_out:
        where = stage_text(stage, result_file)
        if result_file.get("rank_progress"):
            where = "; ".join(result_file["rank_progress"])  # a multi-process trial: every rank's
        blame = stack_blame(stacks or [])
        if blame is None and stacks is not None and stage is not None:
            blame = "no process dumped its stack, so where it hung is unknown"
        outcome, reason = "timeout", f"no result within {timeout:g} s ({where}){': ' + blame if blame else ''}; the trial was killed"
    elif ((exit_code == -SIGKILL or (exception.get("killed") and exception.get("signal") in (None, "SIGKILL")))
          and oom_kills and stage != Stage.DONE):
        # A rank of a multi-process trial that stopped without an error of its own, while the
        # OOM killer was at work, was its victim, unless the rank launcher saw another signal.
        where = f"on rank {exception['rank']}" if exception.get("killed") else stage_text(stage, result_file)
        outcome, reason = "oom", (
            f"out of memory: the kernel's OOM killer ended the script {where} (SIGKILL; its memory "
            f"cgroup counted {oom_kills} OOM kill{'s' if oom_kills != 1 else ''} meanwhile); "
            "use a smaller micro-batch or give the trial more memory"
        )
    elif stage != Stage.DONE and oom_kills != 0 and (worker := _killed_worker(stderr_tail, exception)) is not None:
        counted = "" if oom_kills is None else f"; its memory cgroup counted {oom_kills} OOM kill{'s' if oom_kills != 1 else ''} meanwhile"
        outcome, reason = "oom", (
            f"out of memory: DataLoader worker (pid {worker}) was killed by SIGKILL {stage_text(stage, result_file)}, "
            f"as the kernel's OOM killer ends a process{counted}; use fewer DataLoader workers or a smaller "
            "micro-batch, or give the trial more memory")
    else:
        outcome, reason = _outcome(stage, result_file, exception, exit_code, _last_line(stderr_tail), spec)
    return TrialResult.from_dict({**base, "outcome": outcome, "reason": reason})


# What a person reads for the last mark a lost trial reached.
_MARK_WORDS = {"launched": "launched", "torch_imported": "torch imported"}


def _lost_reason(stage: str | None, timeline: Mapping[str, float], spec: TrialSpec, *, timed_out: bool,
                 timeout: float, exit_code: int | None, oom_kills: int | None, rank: int | None = None) -> str:
    how = f"no result within {timeout:g} s" if timed_out else f"killed by {_exit_text(exit_code)}"
    if rank is not None:
        how += f", rank {rank}"
    if stage is None:
        where = "before load_policy()" if spec.framework is None else "before the trial's boot started"
    elif spec.framework is None:
        where = "inside load_policy(), before the candidate was built"
    else:
        where = f"before the script built its {spec.framework} trainer with the candidate"
    marks = [(at, name) for name, at in timeline.items() if name in _MARK_WORDS and isinstance(at, (int, float))]
    launched = timeline.get("launched")
    if marks and isinstance(launched, (int, float)):
        at, name = max(marks)
        where += f"; last mark: {_MARK_WORDS[name]}, {at - launched:.1f} s after launch"
    oom = (f"; the kernel's OOM killer ended {oom_kills} process{'es' if oom_kills != 1 else ''} meanwhile"
           if oom_kills and not timed_out else "")
    return (f"lost before the candidate was applied ({how}, {where}{oom}): a failure of the machine or the "
            "script's start-up, not of the candidate")


# What torch's DataLoader raises in the script when a worker process died by a signal: the
# signal's strsignal() text ("Killed" is SIGKILL, the OOM killer's signal).
_WORKER_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: Killed\b")


def _killed_worker(stderr_tail: str, exception: dict[str, Any]) -> str | None:
    found = (_WORKER_KILLED.search(text) for text in (stderr_tail, str(exception.get("message", ""))))
    return next((m.group(1) for m in found if m is not None), None)


def _outcome(stage: str | None, result_file: Mapping[str, Any], exception: dict[str, Any],
             exit_code: int | None, last_line: str, spec: TrialSpec) -> tuple[str, str]:
    """``(outcome, reason)`` of a child that ended by itself, from the last stage it reached."""
    if stage == Stage.UNSUPPORTED:
        return "unsupported", result_file.get("reason") or "mode not supported on this hardware"
    if stage == Stage.NO_STEP and result_file.get("reason"):
        return "no-step", str(result_file["reason"])  # the adapter's own line: what the script reached
    if stage == Stage.NO_STEP:
        what = (f"the script never called step() within {spec.first_step_timeout:g} s of the policy's application "
                "(load_policy())"
                if spec.framework is None else
                f"the script's {spec.framework} training ran no optimizer step within {spec.first_step_timeout:g} s "
                "of the policy's application (its trainer built with the candidate)")
        return "no-step", f"{what} (time spent compiling with torch.compile not counted)"
    if stage == Stage.EXCEPTION or (stage not in (None, Stage.DONE) and exit_code not in (0, None)):
        return _failure(exception, exit_code, last_line)
    if stage is None and exit_code not in (0, None):
        return "no-policy", ("the script failed before load_policy() (exit "
                             f"{_exit_text(exit_code)}): {last_line or 'no error message'}")
    if stage is None:
        return "no-policy", "the script exited without calling advisor.load_policy()"
    if stage == Stage.LOADED or (stage == Stage.STEPPING and not result_file.get("losses")):
        if spec.framework is not None:
            return "no-step", f"the script ended before its {spec.framework} training ran an optimizer step"
        return "no-step", "the script ended without calling step(); call mp.step(loss, optimizer) in the training loop"
    if stage == Stage.STEPPING:
        return "crash", (f"the script stopped after {len(result_file['losses'])} steps without "
                         f"finishing the trial (exit {_exit_text(exit_code)})")
    # stage == Stage.DONE
    peak = result_file.get("peak_memory")
    if spec.memory_limit is not None and peak is not None and peak > spec.memory_limit:
        return "oom", f"peak memory {peak / 2**20:.0f} MiB exceeds the limit {spec.memory_limit / 2**20:.0f} MiB"
    return "ok", ""


def _failure(exception: dict[str, Any], exit_code: int | None, last_line: str) -> tuple[str, str]:
    kind = exception.get("type", "")
    message = exception.get("message", "") or last_line
    rank = exception.get("rank")
    on_rank = "" if rank is None else f" on rank {rank}"  # a multi-process trial names the rank
    # "can't allocate memory": torch's CPU allocator.
    if "OutOfMemoryError" in kind or kind == "MemoryError" or any(
            text in message.lower() for text in ("out of memory", "can't allocate memory")):
        return "oom", f"out of memory{on_rank}: {message}".strip()
    if kind == "MpadviseError":
        return "crash", message
    what = f"{kind}: {message}" if kind else (message or "no error message")
    return "crash", f"the script crashed{on_rank} (exit {_exit_text(exit_code)}): {what}"


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return str(code)


def _last_line(tail: str) -> str:
    for line in reversed(tail.splitlines()):
        line = line.strip()
        if line and not line.startswith(("mpadvise:", "W1", "I1")):
            return line
    return ""
