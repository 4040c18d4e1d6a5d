"""One trial result from a multi-process trial's ranks: the first to fail blamed, else merged."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._schema import Stage, json_float, stage_text
from ._timeline import merge_timelines


def merge_rank_results(ranks: Sequence[Mapping[str, Any] | None],
                       exits: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    """One trial result from its ranks' result files (index = rank; ``None`` for a rank that
    wrote none) and the rank launcher's record of how each ended (``exits``; ``None`` on a
    timeout); ``None`` when no rank wrote anything.

    A failed rank fails the trial, named: with the record, the rank that ended first with a
    failure of its own (not the healthy peer that lost its connection to it afterwards); else
    the earliest exception, an unsupported rank, one that never stepped, wrote nothing, or
    stopped while others finished. When none failed but not all finished, the result is a rank's
    that had not applied the candidate, if any (``lost``), else rank 0's. When all finished,
    their steps are merged (``_merge_finished``)."""
    present = {rank: dict(data) for rank, data in enumerate(ranks) if data}
    if not present:
        return None
    failed = _failed_rank(ranks, present, exits)
    if failed is not None:
        return {**failed, "ranks": len(ranks)}
    if any(data.get("stage") != Stage.DONE for data in present.values()):
        progress = [f"rank {rank} {stage_text((data or {}).get('stage'), data or {})}" for rank, data in enumerate(ranks)]
        waiting = [rank for rank, data in enumerate(ranks)
                   if not (data and ("policy_applied" in (data.get("timeline") or {}) or data.get("losses")))]
        chosen = {**(ranks[waiting[0]] or {}), "rank_waiting": waiting[0]} if waiting else present[min(present)]
        return {**chosen, "ranks": len(ranks), "rank_progress": progress}
    return _merge_finished(ranks, present)


def _failed_rank(ranks: Sequence[Mapping[str, Any] | None], present: dict[int, dict[str, Any]],
                 exits: Mapping[str, Any] | None = None) -> dict[str, Any] | None:
    # The first rank the launcher saw fail by itself (not stopped after another's failure).
    record = (exits.get("ended") or []) if isinstance(exits, Mapping) else []
    ended = next((e for e in record if isinstance(e, Mapping) and e.get("status") not in (0, None)
                  and not e.get("stopped")), None)
    if ended is not None:
        rank = int(ended["rank"])
        data = present.get(rank, {})
        stage, exception = data.get("stage"), data.get("exception") or {}
        if stage == Stage.EXCEPTION and not exception.get("killed"):
            return {**data, "exception": {**exception, "rank": rank}}
        if stage in (Stage.UNSUPPORTED, Stage.NO_STEP):
            return data
        how = f"was killed by {ended['signal']}" if ended.get("signal") else f"exited with status {ended.get('status')}"
        message = f"rank {rank} {how} {stage_text(stage, data)} without an error of its own; its peers were stopped after it"
        return {**data, "stage": Stage.EXCEPTION,
                "exception": {"type": "", "message": message, "rank": rank, "killed": True, "signal": ended.get("signal"),
                              "no_result": not data}}
    raised = [(data.get("exception") or {}, rank) for rank, data in present.items() if data.get("stage") == Stage.EXCEPTION]
    if raised:
        exception, rank = min(raised, key=lambda item: (_number(item[0].get("at")), item[1]))
        return {**present[rank], "exception": {**exception, "rank": rank}}
    for stage in (Stage.UNSUPPORTED, Stage.NO_STEP):
        for data in present.values():
            if data.get("stage") == stage:
                return data
    missing = [rank for rank, data in enumerate(ranks) if not data]
    if missing:
        message = (f"rank {missing[0]} wrote no result: it ended, or was ended, before calling "
                   "advisor.load_policy()")
        # The rank's own (empty) result: it had not applied the candidate, which decides ``lost``.
        return {"stage": Stage.EXCEPTION, "exception": {"type": "", "message": message, "rank": missing[0],
                                                        "killed": True, "no_result": True}}
    finished = [rank for rank, data in present.items() if data.get("stage") == Stage.DONE]
    stopped = [rank for rank in present if rank not in finished]
    if not (finished and stopped):
        return None
    rank = stopped[0]
    message = (f"rank {rank} stopped {stage_text(present[rank].get('stage'), present[rank])} without "
               f"an error of its own, while rank {finished[0]} finished (killed by a signal, or ended "
               "by its launcher)")
    return {**present[min(present)], "stage": Stage.EXCEPTION,
            "exception": {"type": "", "message": message, "rank": rank, "killed": True}}


def _merge_finished(ranks: Sequence[Mapping[str, Any] | None], present: dict[int, dict[str, Any]]) -> dict[str, Any]:
    order = sorted(present)
    first = present[order[0]]
    steps = min(len(present[r].get("losses") or []) for r in order)

    def column(name: str, rank: int) -> list[Any]:
        values = list(present[rank].get(name) or [])
        return values[:steps] + [None] * (steps - len(values))

    skipped = {r: [bool(v) for v in column("skipped", r)] for r in order}
    losses, samples, times, underflow = [], [], [], []
    notes = list(dict.fromkeys(n for r in order for n in present[r].get("notes") or []))
    for step in range(steps):
        skip = [r for r in order if skipped[r][step]]
        took = [r for r in order if not skipped[r][step]]
        if skip and took:
            message = (f"the ranks disagree on skipped steps: step {step} was skipped on rank "
                       f"{', '.join(map(str, skip))} but taken on rank {', '.join(map(str, took))}, so their "
                       "weights no longer match; the loss scaler must decide on every rank's gradients alike")
            return {**first, "stage": Stage.EXCEPTION, "ranks": len(ranks),
                    "exception": {"type": "MpadviseError", "message": message, "rank": skip[0]}}
        values = [float(column("losses", r)[step]) for r in order]
        counts = [column("samples", r)[step] for r in order]
        bad = [v for v in values if not math.isfinite(v)]
        if bad and all(math.isfinite(v) for v in losses):
            # In DDP the other ranks follow one step later: name the ranks where it began.
            culprits = [r for r, v in zip(order, values) if not math.isfinite(v)]
            notes.append(f"the first non-finite loss came at step {step} on rank "
                         f"{', '.join(map(str, culprits))}")
        if bad:
            losses.append(next((v for v in bad if math.isnan(v)), bad[0]))
        elif all(isinstance(c, int) and c > 0 for c in counts):
            losses.append(sum(v * c for v, c in zip(values, counts)) / sum(counts))
        else:
            losses.append(sum(values) / len(values))
        samples.append(sum(c for c in counts if isinstance(c, int)))
        step_times = [t for t in (column("step_times", r)[step] for r in order) if t is not None]
        times.append(max(step_times) if step_times else None)
        fractions = [u for u in (column("underflow", r)[step] for r in order) if u is not None]
        underflow.append(sum(fractions) / len(fractions) if fractions else None)
    peaks = [present[r].get("peak_memory") for r in order if present[r].get("peak_memory") is not None]
    complete = all(present[r].get("complete", True) for r in order) and all(
        len(present[r].get("losses") or []) == steps for r in order)
    return {
        **first,
        "losses": [json_float(v) for v in losses],
        "step_times": [t for t in times if t is not None],
        "samples": samples,
        "skipped": skipped[order[0]],
        "loss_scale": column("loss_scale", order[0]),
        "underflow": underflow,
        "peak_memory": max(peaks) if peaks else None,
        "notes": notes,
        "complete": complete,
        "fsdp": any(present[r].get("fsdp") for r in order),
        "ranks": len(ranks),
        "timeline": merge_timelines([present[r].get("timeline") or {} for r in order]),
        **_merged_flops([present[r] for r in order]),
    }


def _merged_flops(ranks: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The node's FLOPs per step: the sum of every rank's; unknown unless every rank has one."""
    counts = [data.get("flops_per_step") for data in ranks]
    if not counts or not all(isinstance(c, (int, float)) and not isinstance(c, bool) for c in counts):
        return {"flops_per_step": None, "flops_basis": None} if any("flops_per_step" in d for d in ranks) else {}
    return {"flops_per_step": float(sum(counts)), "flops_basis": ranks[0].get("flops_basis")}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.inf
