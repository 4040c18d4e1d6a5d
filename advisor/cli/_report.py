"""How trial and tune results are shown: rich tables, progress, and the optional plot."""

from __future__ import annotations

import math
import os
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from advisor.tune import (
    default_storage_url,
    run_ratio_text,
    shared_storage,
)
from policies import Policy
from probes import MpadviseError

if TYPE_CHECKING:
    from advisor.tune import Evaluation, Measured

VERDICT_STYLE = {"ok": "green", "unstable": "yellow", "pruned": "dim"}


def fmt_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    if value >= 2**30:
        return f"{value / 2**30:.2f} GiB"
    return f"{value / 2**20:.0f} MiB"


def evaluation_table(reference: Evaluation, evaluations: list[Evaluation], *, title: str) -> Table:
    """Mode, samples/s, speed-up vs fp32 with its spread, peak memory, final-loss gap, skips and
    verdict; the reasons go under the table (:func:`print_reasons`), and a legend line says what
    each short header means, so the table fits 80 columns."""
    skips = any(any(ev.result.skipped) for ev in [reference, *evaluations])
    legend = ("goodput: samples/s, skipped steps lost; ×fp32: speed-up over the fp32 reference, ± half its step times' "
              "interquartile range, ≈ a tie within that noise; memory: peak; Δloss: final loss against fp32's"
              + ("; skips: steps the GradScaler skipped" if skips else ""))
    table = compact_table(title, legend)
    table.add_column("candidate", overflow="fold", min_width=11, ratio=1)
    for name in ("goodput", "×fp32", "memory", "Δloss", *(("skips",) if skips else ())):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for ev in [reference, *evaluations]:
        outcome = ev.outcome
        style = VERDICT_STYLE.get(outcome, "red")
        if ev is reference:
            speed = "1.00x"
        elif ev.speedup is None:
            speed = "-"
        else:
            speed = f"{ev.speedup:.2f}x" + ("≈" if ev.speed_verdict == "tie" else "")
        spread = _spread_text(None if ev.timing is None else ev.timing.rel_iqr / 2)
        gap = "-" if ev.final_loss_gap is None or ev is reference else f"{ev.final_loss_gap:+.1%}"
        row = [escape(ev.label), "-" if ev.goodput is None else f"{ev.goodput:,.0f}",
               speed + (f" {spread}" if spread and speed != "-" else ""), fmt_bytes(ev.result.peak_memory), gap]
        if skips:
            row.append(str(sum(1 for s in ev.result.skipped if s)) if ev.result.skipped else "-")
        table.add_row(*row, f"[{style}]{outcome}[/]")
    return table


def compact_table(title: str | None, legend: str | None = None) -> Table:
    """A table in the CLI's compact style: no outer frame, a rule under the headers, and
    ``legend`` (what each short header means) as its caption, wrapped to the terminal."""
    return Table(title=title, title_justify="left", caption=legend, caption_justify="left", box=box.MINIMAL_HEAVY_HEAD,
                 show_edge=False, pad_edge=False)


def _spread_text(half_spread: float | None) -> str:
    """``±12%``: half a spread, relative to the median; empty when unknown."""
    if half_spread is None or not math.isfinite(half_spread) or half_spread < 0:
        return ""
    return f"±{half_spread:.0%}" if half_spread >= 0.005 else "±0%"


def print_reasons(console: Console, evaluations: list[Evaluation]) -> None:
    """The verdict reason of each candidate, one paragraph each, under the table."""
    for ev in evaluations:
        style = VERDICT_STYLE.get(ev.outcome, "red")
        reason = ev.reason or "ok"
        console.print(f"[{style}]{ev.label}[/]: {reason}", highlight=False)
        if ev.outcome not in ("ok", "unstable") and ev.result.stderr_tail:
            tail = "\n".join(ev.result.stderr_tail.splitlines()[-5:])
            console.print(f"[dim]{tail}[/]", highlight=False, markup=False)
        for note in ev.result.notes:
            console.print(f"  note: {note}", highlight=False)


def spread_line(reference: dict[str, Any], replicate: dict[str, Any] | None) -> str:
    """How far one rounding carried fp32 (its perturbed replicate), and the limits that set, in
    one line; empty without a replicate.

    Args:
        reference: the reference's evaluation as JSON (its verdict's metrics hold the spread).
        replicate: the replicate as JSON (``Replicate.to_dict``), or ``None``.
    """
    if not replicate:
        return ""
    if replicate.get("note"):
        return f"run-to-run spread: not measured, {replicate['note']}; the fixed limits apply"
    who = f"fp32 perturbed by one {replicate.get('perturb') or 'bf16'} rounding"
    if replicate.get("identical"):
        return (f"run-to-run spread: {who} trained bit for bit as fp32 (the perturbation never reached the "
                "trained weights); the fixed limits apply")
    metrics = (reference.get("verdict") or {}).get("metrics") or {}
    if "final_gap_limit" not in metrics:
        return f"run-to-run spread: {who} ran, but its spread was not used; the fixed limits apply"
    apart = f"{_as_float(metrics.get('final_spread')):.1%} apart"
    if "progress_spread" in metrics:
        apart += f", its fall {_as_float(metrics['progress_spread']):.0%} off fp32's"
    limits = f"final loss up to {_as_float(metrics['final_gap_limit']):.1%} above fp32's"
    if metrics.get("reference_flat"):
        limits += "; progress is not judged, since fp32's own fall is within that noise"
    elif "progress_limit" in metrics:
        limits += f", a fall at least {_as_float(metrics['progress_limit']):.0%} as far as fp32's"
    reused = " (reused from the stored study)" if replicate.get("reused") else ""
    return (f"run-to-run spread: {who} ended at {_as_float(metrics.get('replicate_end')):.4g} "
            f"against {_as_float(metrics.get('reference_end')):.4g} ({apart}){reused}; "
            f"the limits allow for it: {limits}")


def _as_float(value: Any) -> float:
    """A metric from JSON, where non-finite numbers are strings such as ``"inf"``."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def progress_console(console: Console) -> Console:
    """Where progress goes: stderr, always, so that stdout holds only the result (a table or
    JSON) and ``mpadvise tune train.py > result.txt`` captures no bar; a console that already
    writes elsewhere (a file, a test's recording) is kept."""
    if console.file is sys.stdout:
        return Console(stderr=True)
    return console


@contextmanager
def trial_progress(console: Console, total: int, *, enabled: bool = True) -> Iterator[Any]:
    """A progress bar over trials; yields ``(on_start, on_done)`` callbacks for the runners."""
    if not enabled:
        yield (lambda i, label: None, lambda i, ev: None)
        return
    progress = Progress(
        SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
        TimeElapsedColumn(), console=progress_console(console), transient=False,
    )
    with progress:
        task = progress.add_task("trials", total=total)

        def on_start(i: int, label: str) -> None:
            progress.update(task, description=f"trial {i + 1}/{total}: {label}")

        def on_done(i: int, ev: Evaluation) -> None:
            progress.advance(task)
            mark = "[green]ok[/]" if ev.outcome == "ok" else f"[red]{ev.outcome}[/]"
            speed = "" if ev.speedup is None else f", {ev.speedup:.2f}x fp32"
            progress.console.print(f"  {ev.label}: {mark}{speed}", highlight=False)

        yield on_start, on_done


@contextmanager
def tune_progress(console: Console, total: int) -> Iterator[Any]:
    """A progress bar over a tune's trials and then its rounds of re-measurement; yields
    ``(on_start, on_done, on_round)`` for the tuner.

    Args:
        console: where the bar and each trial's line go.
        total: the trials the search may run (its budget, the reference and its replicate).
    """
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=progress_console(console)) as bar:
        task = bar.add_task("starting", total=total)
        started = 0
        phase = ""

        def on_start(label: str) -> None:
            nonlocal started
            started += 1
            bar.update(task, description=f"{phase or f'trial {started}'}: {label}")

        def on_done(label: str, ev: Evaluation | None, m: Measured) -> None:
            bar.advance(task)
            style = VERDICT_STYLE.get(m.outcome, "red")
            bar.console.print(f"  {label}: [{style}]{m.outcome}[/]{run_ratio_text(ev)}", highlight=False)

        def on_round(number: int, most: int, runs: int) -> None:
            # The search is over (what it left of its budget will not run): the bar now counts
            # this round's runs.
            nonlocal phase
            phase = f"re-measure round {number} of at most {most}"
            bar.update(task, total=bar.tasks[task].completed + runs, description=phase)

        yield on_start, on_done, on_round
        bar.update(task, total=bar.tasks[task].completed)  # a search that stopped early completes the bar


def render_tune(tune: dict[str, Any], console: Console) -> None:
    """A tune's summary from its JSON (what ``mpadvise tune --json`` prints, locally or from a
    daemon job): the candidates (those re-measured beside fp32 by their paired figure, then the
    search's single runs), why the others lost, the winner with its one speed-up figure, and
    next steps to paste.

    Args:
        tune: the tune's JSON, decoded.
        console: where to print.
    """
    console.print(_tune_table(tune))
    noisy = noisy_line(tune)
    if noisy:
        console.print(f"[yellow]{escape(noisy)}[/]", highlight=False)
    if tune.get("window_note"):
        console.print(f"window: {tune['window_note']}", highlight=False)
    if tune.get("extended_window"):
        console.print(f"judged again on a longer window, their gap to fp32 growing: {', '.join(tune['extended_window'])}",
                      highlight=False)
    print_disturbances(console, tune.get("disturbed") or [])
    console.print(utilisation_line(tune), highlight=False)
    spread = spread_line(tune.get("reference") or {}, tune.get("replicate"))
    if spread:
        console.print(spread, highlight=False)
    for row in tune.get("candidates") or []:
        if not (row.get("stable") and row.get("feasible")) and row.get("reason"):
            console.print(f"[{VERDICT_STYLE.get(row.get('outcome'), 'red')}]{row.get('label')}[/]: {row['reason']}",
                          highlight=False)
    _print_search(tune, console)
    cost = cost_line(tune.get("cost"))
    if cost:
        console.print(cost, highlight=False)
    if tune.get("winner") is None:
        console.print("[bold red]no stable policy fits[/]: every candidate was unstable, out of memory or failed")
        return
    _print_winner(tune, console)


# Above this half-spread a speed-up is called rough: step times this scattered hide a gap of the
# size that separates modes (the design's 2-core build machine sees about ±10% between quartiles).
NOISY_SPREAD = 0.25


def _tune_table(tune: dict[str, Any]) -> Table:
    """The candidates in two parts, so that no ratio is read as another kind: above the rule,
    the winner and whoever ran beside fp32 in this run's re-measurement, by that figure (the
    winner's is the tune's one speed-up, marked †); below it, the search's single runs."""
    resumed = tune.get("trials_resumed") or 0
    title = (f"{Path(tune.get('script') or '?').name} on {(tune.get('hardware') or {}).get('name', '?')}: "
             f"the fp32 reference and {tune.get('trials_run', 0)} trials"
             + (f", {resumed} resumed" if resumed else "")
             + f" of {(tune.get('space') or {}).get('grid_size', '?')} candidates")
    rows = list(tune.get("candidates") or [])
    paired = [row for row in rows if _shows_paired(tune, row)]
    if paired and not any(row.get("winner") for row in paired):
        paired = []  # nothing to set apart: the winner's figure is a single run's too
    if paired:  # fp32 heads its own scale
        paired += [row for row in rows if row.get("mode") == "fp32" and not row.get("micro_batch")
                   and row not in paired and _is_reference_row(tune, row)]
    single = [row for row in rows if row not in paired]
    legend = ("×fp32: goodput over fp32's" + (", above the rule re-measured side by side in this run, ± half its "
                                              "interval; below it, " if paired else " in ")
              + "one search run, ± the spread of its step times; goodput: samples/s, skipped steps lost; "
              "TF/s: achieved TFLOP/s; MFU: of the probed peak; memory: peak")
    if any(row.get("resumed") for row in single):
        legend += "; *: an earlier run's or another worker's figure (resumed), never compared with this run's fp32"
    speedup = tune.get("speedup") or {}
    if tune.get("speedup_vs_fp32"):
        legend += f"\n† the winner's speed-up: {describe_speedup(speedup)}, the tune's one figure"
    # Short headers, explained by the legend; numbers and verdicts never wrap, labels wrap at
    # their spaces, so the table fits 80 columns with every figure whole.
    table = compact_table(title, legend)
    table.add_column("", no_wrap=True)
    table.add_column("candidate", overflow="fold", min_width=11, ratio=1)
    for col in ("goodput", "×fp32", "TF/s", "MFU", "memory"):
        table.add_column(col, justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True)
    for row in sorted(paired, key=lambda r: -(row_speedup(tune, r) or 0.0)):
        _add_row(table, tune, row, goodput=_remeasured_goodput(tune, row))
    if paired and single:
        table.add_section()
    for row in single:
        _add_row(table, tune, row, goodput=row.get("goodput"))
    for row in tune.get("pruned") or []:  # never run: no numbers to show
        table.add_row("", escape(str(row.get("label"))), "-", "-", "-", "-", "-", f"[{VERDICT_STYLE['pruned']}]pruned[/]")
    return table


def _add_row(table: Table, tune: dict[str, Any], row: dict[str, Any], *, goodput: float | None) -> None:
    outcome, won = row.get("outcome") or "ok", bool(row.get("winner"))
    ratio = row_speedup(tune, row)
    cell = f"{ratio:.2f}x" + ("†" if won else "") if goodput and ratio else "-"
    spread = _spread_text(candidate_spread(tune, row)) if cell != "-" else ""
    shown_goodput = f"{goodput:,.0f}" + ("*" if row.get("resumed") and not _shows_paired(tune, row) else "") if goodput else "-"
    table.add_row("→" if won else "", escape(str(row.get("label"))), shown_goodput,
                  cell + (f" {spread}" if spread else ""), fmt_tflops(row.get("tflops")), fmt_mfu(row.get("mfu")),
                  fmt_bytes(row.get("peak_memory")), f"[{VERDICT_STYLE.get(outcome, 'red')}]{outcome}[/]")


def _shows_paired(tune: dict[str, Any], row: dict[str, Any]) -> bool:
    """Whether a row's ×fp32 is a paired figure of this run (the winner's, when it is paired)."""
    if row.get("winner"):
        return bool((tune.get("speedup") or {}).get("pairs"))
    return bool((row.get("paired_speedup") or {}).get("ratio"))


def _is_reference_row(tune: dict[str, Any], row: dict[str, Any]) -> bool:
    return row.get("label") == (tune.get("reference") or {}).get("label", "fp32") and bool(tune.get("reference_rounds"))


def row_speedup(tune: dict[str, Any], row: dict[str, Any]) -> float | None:
    """The ×fp32 figure a tune table row shows: the winner's one figure; a re-measured
    finalist's paired figure of this run; 1 for fp32 beside them; else the search run's ratio
    (``None`` for a resumed result, never compared with this run's fp32)."""
    if row.get("winner"):
        return tune.get("speedup_vs_fp32")
    if _shows_paired(tune, row):
        return row["paired_speedup"]["ratio"]
    return row.get("search_speedup_vs_fp32", row.get("speedup_vs_fp32"))


def _remeasured_goodput(tune: dict[str, Any], row: dict[str, Any]) -> float | None:
    """A row's median goodput over its rounds of re-measurement (fp32's alongside for fp32); its
    search run's when it has none."""
    if _is_reference_row(tune, row) and not row.get("winner"):
        rounds = tune.get("reference_rounds") or []
    else:
        rounds = next((f.get("rounds") or [] for f in tune.get("finalists") or [] if f.get("label") == row.get("label")), [])
    return _median_round({"rounds": rounds, "goodput": row.get("goodput")}) or row.get("goodput")


def candidate_spread(tune: dict[str, Any], row: dict[str, Any]) -> float | None:
    """How far the ×fp32 figure a row shows could move with its timing noise, as a fraction
    (half a spread): a paired figure's interval (its rounds' range without one); a search
    run's step times (p10 to p90, or the interquartile range); ``None`` where the tune's JSON
    has none.

    Args:
        tune: the tune's JSON.
        row: one of its ``candidates``.
    """
    beside = _is_reference_row(tune, row) and any(_shows_paired(tune, r) for r in tune.get("candidates") or [])
    if _shows_paired(tune, row) or beside:
        figure = (tune.get("speedup") or {}) if row.get("winner") else (row.get("paired_speedup") or {})
        ratio, low, high = figure.get("ratio"), figure.get("low"), figure.get("high")
        if ratio and low and high:
            return (high - low) / 2 / ratio
        rounds = (tune.get("reference_rounds") if _is_reference_row(tune, row) and not row.get("winner") else
                  next((f.get("rounds") for f in tune.get("finalists") or [] if f.get("label") == row.get("label")), None))
        runs = sorted(g for g in rounds or [] if isinstance(g, (int, float)) and g > 0)
        if len(runs) > 1:
            return (runs[-1] - runs[0]) / 2 / runs[len(runs) // 2]
    p10, p90 = row.get("step_time_p10"), row.get("step_time_p90")
    if isinstance(p10, (int, float)) and isinstance(p90, (int, float)) and p10 > 0:
        return (p90 / p10 - 1) / 2
    if isinstance(row.get("step_spread"), (int, float)):  # p90 over p10 of its step times
        return (row["step_spread"] - 1) / 2
    timing = row.get("step_time") or ((tune.get("reference") or {}).get("step_time") if row.get("mode") == "fp32"
                                       and not row.get("micro_batch") else None)
    if isinstance(timing, dict) and isinstance(timing.get("rel_iqr"), (int, float)):
        return timing["rel_iqr"] / 2
    return None


def noisy_line(tune: dict[str, Any]) -> str:
    """A warning naming the candidates whose speed-up rests on timings spread wider than
    ±NOISY_SPREAD; empty when none is."""
    noisy = []
    for row in tune.get("candidates") or []:
        spread = candidate_spread(tune, row)
        if row.get("goodput") and spread is not None and spread > NOISY_SPREAD:
            noisy.append(f"{row.get('label')} {_spread_text(spread)}")
    if not noisy:
        return ""
    return (f"noisy timings: {', '.join(noisy)}; their speed-ups are rough (another job or a busy GPU ran beside "
            "them): tune again on a quieter machine, or with more --steps")


def cost_line(cost: dict[str, Any] | None) -> str | None:
    """What the tune cost: its trials, its wall time in trial-equivalents (one measured window
    each), and the share of a trial that start-up took; ``None`` when unknown."""
    if not cost:
        return None
    line = f"cost: {cost.get('trials')} trials in {cost.get('wall_s', 0):.0f} s"
    if cost.get("trial_equivalents"):
        line += f", {cost['trial_equivalents']:.0f} measured windows of {cost['window_s']:.2g} s"
    if cost.get("startup_share") is not None:
        line += f"; start-up took {cost['startup_share']:.0%} of a trial's wall time (median)"
    return line


def fmt_tflops(tflops: float | None) -> str:
    """Achieved TFLOP/s to three significant figures, or ``-`` when unknown."""
    return "-" if tflops is None else f"{tflops:.3g}"


def fmt_mfu(mfu: float | None) -> str:
    """The fraction of the probed peak (``12%``, ``0.4%``), or ``-``."""
    return "-" if mfu is None else f"{mfu:.0%}" if mfu >= 0.01 else f"{mfu:.1%}"


def utilisation_line(tune: dict[str, Any]) -> str:
    """How the TFLOP/s and MFU columns were found: the reference's FLOP count and its basis, and
    the probed matmul peaks they are measured against."""
    flops = tune.get("flops_per_step")
    if not flops:
        return "TFLOP/s and MFU: not known (the reference's FLOPs could not be counted)"
    peaks = ", ".join(f"{k} {v:.3g}" for k, v in (tune.get("peak_tflops") or {}).items())
    basis = tune.get("flops_basis") or "counted"
    rows = tune.get("candidates") or []
    held = ", ".join(f"{row['label']} {row['mfu_dtype']}" for row in rows if row.get("mfu_dtype"))
    above = ", ".join(row["label"] for row in rows if (row.get("mfu") or 0.0) > 1.0)
    return (f"FLOPs per step {flops:.3g} ({basis}, in the fp32 reference); MFU is of the probed matmul "
            f"peak of each candidate's dtype" + (f" ({held})" if held else "")
            + (f"; probed TFLOP/s: {peaks}" if peaks else ": no peak probed")
            + (f"; above 100% ({above}): this workload's matmuls ran faster than the probe's square ones, "
               "so the probed peak is below what this hardware does here" if above else ""))


def _print_search(tune: dict[str, Any], console: Console) -> None:
    """The priors, why the search stopped, the side-by-side re-measurement and any tie."""
    ratios = ", ".join(f"{k} {v:.2g}x" for k, v in (tune.get("matmul_ratio_vs_fp32") or {}).items() if k != "fp32")
    if ratios:
        console.print(f"matmul throughput vs fp32 on this device (the search's priors): {ratios}", highlight=False)
    console.print(f"search stopped: {tune.get('stop_reason')}", highlight=False)
    resumed = tune.get("trials_resumed") or 0
    if resumed:
        console.print(f"resumed: {resumed} result{'' if resumed == 1 else 's'} from the stored study (an earlier run's or "
                      "another worker's), never compared with this run's fp32: the finalists among them ran again, "
                      "and the winner's figure is measured side by side in this run", highlight=False)
    pruned = tune.get("pruned") or []
    if pruned:
        console.print(f"pruned (not run): {len(pruned)} proposals the priors ruled out; --no-priors runs them",
                      highlight=False)
    finalists = tune.get("finalists") or []
    rounds = tune.get("remeasure_rounds")
    if len(finalists) > 1:
        close = ", ".join(f"{f['label']} {_median_round(f):,.0f}/s" for f in finalists)
        console.print(f"re-measured side by side{f' in {rounds} rounds' if rounds else ''}: {close}", highlight=False)
    stop = remeasure_stop_line(tune)
    if stop:
        console.print(stop, highlight=False)
    on_threads = on_threads_line(tune.get("speedup") or {})
    if on_threads:
        console.print(on_threads, highlight=False)
    for dropped in tune.get("dropped_finalists") or []:
        console.print(f"[red]dropped[/] {dropped.get('label')}: {dropped.get('reason')}", highlight=False)
    if tune.get("gap"):
        between = tune["gap"].get("between") or []
        # Against fp32, the decisive gap is the speed-up itself; between finalists it is no speed-up.
        rival = "" if between[1:2] == [(tune.get("reference") or {}).get("label", "fp32")] else \
            " (between finalists: not a speed-up over fp32)"
        console.print(f"gap: {describe_gap(tune['gap'])}{rival}", highlight=False)
    if tune.get("tie_note"):
        console.print(f"tie: {tune['tie_note']}", highlight=False)


def _median_round(finalist: dict[str, Any]) -> float:
    """A finalist's median goodput over its rounds (its search run's when it ran none), as the
    table shows it."""
    runs = sorted(g for g in finalist.get("rounds") or [] if isinstance(g, (int, float)) and g > 0)
    if not runs:
        return float(finalist.get("goodput") or 0.0)
    mid = len(runs) // 2
    return runs[mid] if len(runs) % 2 else (runs[mid - 1] + runs[mid]) / 2


def remeasure_stop_line(tune: dict[str, Any]) -> str:
    """Why re-measurement ended, in one line, when that is news (a limit cut it short)."""
    stop, rounds, most = tune.get("remeasure_stop"), tune.get("remeasure_rounds") or 0, tune.get("remeasure_max_rounds")
    if stop == "time budget":
        budget = tune.get("time_budget")
        spent = f" ({budget:g} s)" if isinstance(budget, (int, float)) else ""
        return (f"re-measurement cut short by the time budget{spent} after {rounds} round{'' if rounds == 1 else 's'}: "
                "a gap it left unresolved counts as a tie")
    if stop == "round limit":
        if most and rounds > most:
            return (f"re-measurement stopped after {rounds} rounds, past its usual {most} while a lead lay beyond the "
                    "margin or a change of threads left rounds unpaired: a gap still unresolved counts as a tie")
        return f"re-measurement stopped at its limit of {most} rounds: a gap still unresolved counts as a tie"
    return ""


def on_threads_line(speedup: dict[str, Any]) -> str:
    """A warning when the speed-up was measured on fewer CPU threads than torch's own (other
    processes kept cores busy), else empty."""
    threads, own = speedup.get("threads"), speedup.get("torch_threads")
    if not threads or not own:
        return ""
    return (f"[yellow]the speed-up was measured on {threads} of torch's {own} threads[/]: other processes kept cores "
            "busy through it, and a gain on fewer threads can differ from the gain on all cores: the figure there "
            "needs a tune while they are free")


def describe_speedup(speedup: dict[str, Any]) -> str:
    """The winner's speed-up over fp32 in words: ratio, interval and what it rests on."""
    ratio, low, high = speedup.get("ratio"), speedup.get("low"), speedup.get("high")
    if not ratio:
        return "not measured"
    interval = (f", {speedup.get('confidence', 0.95):.0%} interval {low:.2f}x to {high:.2f}x"
                if low and high and speedup.get("pairs") else "")
    return f"{ratio:.2f}x fp32 goodput ({speedup.get('basis') or 'basis not recorded'}{interval})"


def describe_gap(gap: dict[str, Any]) -> str:
    """A re-measured gap in words: who leads whom, by how much, its interval and verdict."""
    leader, other = (gap.get("between") or ["?", "?"])[:2]
    ratio, low, high = gap.get("ratio"), gap.get("low"), gap.get("high")
    lead = f"{leader} runs {ratio:.2f}x the goodput of {other}" if ratio else f"{leader} against {other}"
    interval = (f"{gap.get('confidence', 0.95):.0%} interval {low:.2f}x to {high:.2f}x over {gap.get('pairs')} paired runs"
                if low and high else f"no interval from {gap.get('pairs', 0)} paired runs")
    verdict = {"faster": "resolved", "slower": "resolved", "tie": "a tie: within the margin that counts",
               "unresolved": "unresolved: counted as a tie"}.get(str(gap.get("verdict")), str(gap.get("verdict")))
    return f"{lead} ({interval}): {verdict}"


def _print_winner(tune: dict[str, Any], console: Console) -> None:
    """The winner, its speedup, the files it went to, and the line to add to the script."""
    try:
        described = Policy.from_dict(tune["winner"]).describe()
    except MpadviseError:  # written by another version: its label still says what won
        described = str(tune.get("winner_label"))
    speedup = tune.get("speedup") or ({"ratio": tune["speedup_vs_fp32"]} if tune.get("speedup_vs_fp32") else None)
    console.print(f"[bold green]winner[/]: {described}" + (f", {describe_speedup(speedup)}" if speedup else ""),
                  highlight=False)
    if tune.get("scale_batch_note"):
        console.print(f"[yellow]note[/]: {tune['scale_batch_note']}", highlight=False)
    if tune.get("config_file"):
        console.print(f"wrote {tune['config_file']}", highlight=False)
    if tune.get("cache_id") is not None:
        console.print(f"cached for this GPU/CPU as entry #{tune['cache_id']} (mpadvise show)", highlight=False)
    if tune.get("storage"):
        # A database server's study is joined as it stands by every worker that runs this tune.
        how = ("every worker running this tune joins it" if shared_storage(tune["storage"])
               else f"continue with: {escape(resume_command(tune))}")
        console.print(f"study {tune.get('study_name')!r} in {tune['storage']} ({how})", highlight=False)
    if tune.get("framework"):
        # A framework script applies its policy with no changed line: through mpadvise run.
        export = shlex.join(["mpadvise", "export", *([pasteable_path(tune["config_file"])] if tune.get("config_file")
                                                      else []), "--to", str(tune["framework"])])
        console.print(f"train with it: [bold]{escape(run_command(tune))}[/] (or {escape(export)})", highlight=False)
    elif tune.get("calls_load_policy"):
        console.print("the script calls advisor.load_policy(): it applies the config file beside it", highlight=False)
    else:
        console.print("add to the script: [bold]mp = advisor.load_policy()[/] (it reads the config file beside it)")


def pasteable_path(path: str | os.PathLike[str]) -> str:
    """A path as a command line pasted here should name it: relative to the working directory
    when it lies under it (``examples/train.py``), else as given."""
    given = Path(path)
    if given.is_absolute():
        try:
            return str(given.relative_to(Path.cwd()))
        except ValueError:
            return str(given)
    return str(given)


def _script_and_args(tune: dict[str, Any]) -> list[str]:
    """The script (as :func:`pasteable_path` names it) and, after ``--``, its arguments."""
    args = [str(a) for a in tune.get("args") or []]
    return [pasteable_path(tune.get("script") or "train.py"), *(["--", *args] if args else [])]


def run_command(tune: dict[str, Any]) -> str:
    """``mpadvise run SCRIPT -- ARGS`` for the tuned script, shell-quoted, to paste where the
    report is read."""
    return shlex.join(["mpadvise", "run", *_script_and_args(tune)])


def resume_command(tune: dict[str, Any]) -> str:
    """``mpadvise tune SCRIPT --resume -- ARGS`` for the tune's study, shell-quoted; with
    ``--storage`` when the study is neither in the default file nor in ``MPADVISE_STORAGE``.
    A tune run from the command line carries its own (``resume_command``: every option as typed,
    ``--nproc-per-node`` included, which names the study); this rebuild serves a tune's JSON
    without it, such as a daemon job's."""
    if tune.get("resume_command"):
        return str(tune["resume_command"])
    storage = tune.get("storage")
    default = default_storage_url()
    where = ["--storage", str(storage)] if storage and storage not in (default, os.environ.get("MPADVISE_STORAGE")) else []
    script, *rest = _script_and_args(tune)
    return shlex.join(["mpadvise", "tune", script, "--resume", *where, *rest])


def print_disturbances(console: Console, events: list[dict[str, Any]]) -> None:
    """One line per trial the machine disturbed or lost (run again), or whose threads changed
    with a busy CPU: ``Disturbance.to_dict``'s."""
    for event in events:
        kind = {"lost": "lost", "busy-cpu": "busy CPU", "cpu-free": "CPU free"}.get(event.get("kind") or "", "disturbed")
        console.print(f"[yellow]{kind}[/] {event.get('text')}", highlight=False)
