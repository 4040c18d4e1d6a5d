"""Progress bars, the trial table, and a tune's report: the answer at a glance (every line fits
80 columns) or, with ``--verbose``, the whole of it (``_report_cells.render_details``)."""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
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

from advisor.cli._report_cells import (
    compact_table,
    fmt_bytes,
    is_reference_row,
    noisy_rows,
    pasteable_path,
    remeasured_goodput,
    render_details,
    row_speedup,
    run_command,
    shows_paired,
    speedup_cell,
    spread_text,
    styled,
)
from advisor.tune import run_ratio_text

if TYPE_CHECKING:
    from advisor.tune import Evaluation, Measured


def render_tune(tune: dict[str, Any], console: Console, *, verbose: bool = False,
                already_tuned: str | None = None) -> None:
    """A tune's report from its JSON (local or a daemon job's); ``already_tuned`` ends it so."""
    (render_details if verbose else render_answer)(tune, console)
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
        tie = "≈" if ev.speed_verdict == "tie" else ""
        speed = ("1.00x" if ev is reference else "-" if ev.speedup is None
                 else f"{ev.speedup:.2f}x{tie}")
        spread = spread_text(None if ev.timing is None else ev.timing.rel_iqr / 2)
        gap = "-" if ev.final_loss_gap is None or ev is reference else f"{ev.final_loss_gap:+.1%}"
        row = [escape(ev.label), "-" if ev.goodput is None else f"{ev.goodput:,.0f}",
               speed + (f" {spread}" if spread and speed != "-" else ""), fmt_bytes(ev.result.peak_memory), gap]
        if skips:
            row.append(str(sum(1 for s in ev.result.skipped if s)) if ev.result.skipped else "-")
        table.add_row(*row, styled(ev.outcome))
    return table


def print_reasons(console: Console, evaluations: list[Evaluation]) -> None:
    for ev in evaluations:
        console.print(f"{styled(ev.outcome, ev.label)}: {ev.reason or 'ok'}", highlight=False)
        if ev.outcome not in ("ok", "unstable") and ev.result.stderr_tail:
            tail = "\n".join(ev.result.stderr_tail.splitlines()[-5:])
            console.print(f"[dim]{tail}[/]", highlight=False, markup=False)
        for note in ev.result.notes:
            console.print(f"  note: {note}", highlight=False)


def _progress(console: Console) -> Progress:
    """A progress bar on stderr, so that stdout holds only the result (another file is kept)."""
    shown_on = Console(stderr=True) if console.file is sys.stdout else console
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                    MofNCompleteColumn(), TimeElapsedColumn(), console=shown_on)


@contextmanager
def trial_progress(console: Console, total: int, *, enabled: bool = True,
                   then: Callable[[int, Evaluation], None] = lambda i, ev: None) -> Iterator[Any]:
    """A progress bar over trials; yields ``(on_start, on_done)``; ``on_done`` calls ``then``."""
    if not enabled:
        yield (lambda i, label: None, then)
        return
    with _progress(console) as bar:
        task = bar.add_task("trials", total=total)

        def on_start(i: int, label: str) -> None:
            bar.update(task, description=f"trial {i + 1}/{total}: {label}")

        def on_done(i: int, ev: Evaluation) -> None:
            bar.advance(task)
            mark = "[green]ok[/]" if ev.outcome == "ok" else f"[red]{ev.outcome}[/]"
            speed = "" if ev.speedup is None else f", {ev.speedup:.2f}x fp32"
            bar.console.print(f"  {ev.label}: {mark}{speed}", highlight=False)
            then(i, ev)

        yield on_start, on_done


@contextmanager
def tune_progress(console: Console, total: int) -> Iterator[Any]:
    """A progress bar over a tune's trials, then its re-measurement; yields its three callbacks."""
    with _progress(console) as bar:
        task = bar.add_task("starting", total=total)
        started, phase = 0, ""

        def on_start(label: str) -> None:
            nonlocal started
            started += 1
            bar.update(task, description=f"{phase or f'trial {started}'}: {label}")

        def on_done(label: str, ev: Evaluation | None, m: Measured) -> None:
            bar.advance(task)
            bar.console.print(f"  {label}: {styled(m.outcome)}{run_ratio_text(ev)}",
                              highlight=False)

        def on_round(number: int, most: int, runs: int) -> None:
            # The search is over (the rest of its budget will not run): count this round's runs.
            nonlocal phase
            phase = f"re-measure round {number} of at most {most}"
            bar.update(task, total=bar.tasks[task].completed + runs, description=phase)

        yield on_start, on_done, on_round
        bar.update(task, total=bar.tasks[task].completed)  # a search that stopped early completes the bar

RUNNERS_UP = 2
MAX_ROWS = 8  # with the other lines, the answer stays within 15

# Words a label is shortened by, in order: the table never wraps a row at 80 columns.
_SHORT = (("-mixed", ""), ("dynamic", "dyn"), ("reduce-", "r"), ("tensorwise", "tw"), ("rowwise", "rw"),
          ("growth ", "g"), ("-torchao", "-ao"))

# What a verdict's reason says, in one word, by the first phrase it holds.
_WHY = (("nan", "nan"), ("non-finite", "nan"), ("overflow", "overflow"), ("skipped", "skips"),
        ("diverg", "diverged"), ("fell", "stalled"), ("progress", "stalled"), ("final loss", "loss-gap"),
        ("memory", "memory"))


def short_label(label: str) -> str:
    """A candidate's label in few characters: ``fp16-mixed dynamic 2^16`` is ``fp16 dyn 2^16``."""
    for long, short in _SHORT:
        label = label.replace(long, short)
    return re.sub(r"\s+", " ", label).strip()


def why_word(row: dict[str, Any]) -> str:
    """One word for why a row lost: its outcome (``oom``), else its reason's (``nan``...)."""
    outcome = str(row.get("outcome") or "ok")
    if row.get("stable") and not row.get("feasible", True):
        return "memory"
    if outcome != "unstable":
        return outcome
    reason = str(row.get("reason") or "").lower()
    return next((word for phrase, word in _WHY if phrase in reason), "unstable")


def answer_rows(tune: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows the short table shows, in order: the winner, the runners-up (stable, fastest
    first), fp32, then one row for each mode that failed (its first), at most ``MAX_ROWS``."""
    rows = list(tune.get("candidates") or [])
    winner = [row for row in rows if row.get("winner")]
    good = sorted((row for row in rows if row.get("stable") and row.get("feasible") and not row.get("winner")
                   and not _is_fp32(row)), key=lambda r: -(row_speedup(tune, r) or 0.0))
    fp32 = [row for row in rows if _is_fp32(row) and not row.get("winner")][:1]
    failed: dict[Any, dict[str, Any]] = {}  # by mode, its first row
    for row in rows:
        if not (row.get("stable") and row.get("feasible")):
            failed.setdefault(row.get("mode"), row)
    return [*winner, *good[:RUNNERS_UP], *fp32, *failed.values()][:MAX_ROWS]


def _is_fp32(row: dict[str, Any]) -> bool:
    return row.get("mode") == "fp32" and not row.get("micro_batch") and not (row.get("policy") or {}).get(
        "micro_batch_size")


def _table(tune: dict[str, Any], rows: list[dict[str, Any]]) -> Table:
    table = compact_table(None)
    table.add_column("", no_wrap=True)
    table.add_column("candidate", no_wrap=True, overflow="ellipsis", max_width=34)
    table.add_column("goodput", justify="right", no_wrap=True)
    table.add_column("×fp32", justify="right", no_wrap=True)
    table.add_column("verdict", no_wrap=True, overflow="ellipsis", max_width=11)
    for row in rows:
        ok = bool(row.get("stable") and row.get("feasible"))
        remeasured = shows_paired(tune, row) or is_reference_row(tune, row)
        goodput = remeasured_goodput(tune, row) if remeasured else row.get("goodput")
        outcome = "ok" if ok else str(row.get("outcome") or "ok")
        table.add_row("→" if row.get("winner") else "", escape(short_label(str(row.get("label")))),
                      f"{goodput:,.0f}" if goodput else "-", speedup_cell(tune, row, goodput),
                      styled(outcome, escape("ok" if ok else why_word(row))))
    return table


def render_answer(tune: dict[str, Any], console: Console) -> None:
    def line(text: str, style: str = "") -> None:
        console.print(f"[{style}]{escape(text)}[/]" if style else escape(text), highlight=False)

    rows = answer_rows(tune)
    if tune.get("winner") is None:
        line("no stable policy fits: every candidate was unstable, out of memory or failed", "bold red")
    else:  # winner: bf16 mb32, 1.42x fp32 goodput (95% interval 1.38x-1.46x)
        speedup = tune.get("speedup") or {}
        ratio = speedup.get("ratio") or tune.get("speedup_vs_fp32")
        low, high = speedup.get("low"), speedup.get("high")
        if low and high and speedup.get("pairs"):
            how = f"{speedup.get('confidence', 0.95):.0%} interval {low:.2f}x-{high:.2f}x"
        else:
            how = speedup.get("basis") or "one run"
        figure = f", {ratio:.2f}x fp32 goodput ({how})" if ratio else ""
        line(f"winner: {short_label(str(tune.get('winner_label') or '?'))}{figure}", "bold green")
    if rows:
        console.print(_table(tune, rows))
    # A note on the machine only where its noise made the answer less sure.
    if noisy := noisy_rows(tune, rows, short_label):
        line(f"note: a busy machine made timings noisy ({', '.join(noisy[:2])}): figures are rough",
             "yellow")
    for late in tune.get("late") or []:
        line(f"not run: {late['mode']}, {late['reason']}", "yellow")
    if tune.get("winner") is None:
        line("next: mpadvise tune --verbose shows why each one failed")
        return
    where = f"config: {pasteable_path(tune['config_file'])}" if tune.get("config_file") else "config: not written"
    if tune.get("cache_id") is not None:
        where += f" (cached, entry #{tune['cache_id']})"
    line(where)
    if tune.get("framework"):
        line(f"next: {run_command(tune)}")
    elif tune.get("calls_load_policy"):
        line("next: run the script as usual (its advisor.load_policy() applies it)")
    else:
        line("next: add mp = advisor.load_policy() to the script")
