"""Progress bars, the trial table, and a tune's report: the answer at a glance
(``_report_answer``) or, with ``--verbose``, the whole of it (``_report_details``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

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

from advisor.cli._report_answer import render_answer
from advisor.cli._report_cells import VERDICT_STYLE, compact_table, fmt_bytes, spread_text
from advisor.cli._report_details import render_details
from advisor.tune import run_ratio_text

if TYPE_CHECKING:
    from advisor.tune import Evaluation, Measured


def render_tune(tune: dict[str, Any], console: Console, *, verbose: bool = False,
                already_tuned: str | None = None) -> None:
    """A tune's report from its JSON (``mpadvise tune --json``'s, local or a daemon job's);
    ``already_tuned`` (when the answer was) ends it saying so, and how to tune again."""
    if verbose:
        render_details(tune, console)
    else:
        render_answer(tune, console)
    if already_tuned:
        console.print(f"already tuned {already_tuned}: mpadvise tune --fresh to tune again", highlight=False,
                      markup=False, soft_wrap=True)


def evaluation_table(reference: Evaluation, evaluations: list[Evaluation], *, title: str) -> Table:
    """The trial table; short headers, which its legend explains, so that it fits 80 columns."""
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
        spread = spread_text(None if ev.timing is None else ev.timing.rel_iqr / 2)
        gap = "-" if ev.final_loss_gap is None or ev is reference else f"{ev.final_loss_gap:+.1%}"
        row = [escape(ev.label), "-" if ev.goodput is None else f"{ev.goodput:,.0f}",
               speed + (f" {spread}" if spread and speed != "-" else ""), fmt_bytes(ev.result.peak_memory), gap]
        if skips:
            row.append(str(sum(1 for s in ev.result.skipped if s)) if ev.result.skipped else "-")
        table.add_row(*row, f"[{style}]{outcome}[/]")
    return table


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


def progress_console(console: Console) -> Console:
    """Where progress goes: stderr, so that stdout holds only the result; a console that already
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
    """A progress bar over a tune's ``total`` trials and then its rounds of re-measurement;
    yields ``(on_start, on_done, on_round)`` for the tuner."""
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
