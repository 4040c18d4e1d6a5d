"""``mpadvise tune``: search, report, write the config file, remember the answer."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

import probes
from advisor._log import get_logger
from advisor._paths import config_path_for
from advisor.cli._report import VERDICT_STYLE, fmt_bytes
from advisor.tune._checks import check_modes, check_script
from advisor.tune._engine import TuneResult, tune_policy
from advisor.tune._search import check_storage
from advisor.tune._trials import WAIT_IDLE_ENV, ScriptRunner, TrialSettings
from probes import MpadviseError, hardware_fingerprint
from probes._trial import parse_memory

EXIT_FOUND, EXIT_NONE_STABLE = 0, 3


def default_storage() -> str | None:
    """The study database in the cache directory, or ``None`` (in memory) when unusable."""
    from advisor._paths import cache_dir

    directory = cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        get_logger().warning(f"cache directory {directory} is not writable ({exc.strerror or exc}); the study is kept in memory, so --resume will not work")
        return None
    return f"sqlite:///{directory / 'studies.db'}"


def study_name_for(script: Path, args: list[str], fingerprint: str) -> str:
    digest = hashlib.sha256(json.dumps([str(script), args]).encode()).hexdigest()[:8]
    return f"{script.stem}-{fingerprint}-{digest}"


def run_tune_command(
    script: Path,
    script_args: list[str],
    *,
    trials: int,
    time_budget: float | None,
    steps: int,
    warmup: int,
    memory_limit: str | None,
    timeout: float,
    seed: int,
    device: str | None,
    modes: list[str],
    scale_batch: bool,
    include_emulated: bool,
    storage: str | None,
    resume: bool,
    out: Path | None,
    cache: bool,
    use_priors: bool,
    json_output: bool,
    console: Console,
) -> int:
    """Run the tune and report it. Returns 0 when a stable policy was found, 3 when none was."""

    path = check_script(script)
    if trials < 1:
        raise MpadviseError(f"--trials {trials} is not allowed; expected at least 1")
    if time_budget is not None and time_budget <= 0:
        raise MpadviseError(f"--time-budget {time_budget:g} is not allowed; expected seconds > 0")
    profile = probes.profile_for(device)
    if modes:
        modes = check_modes(modes, profile)
    limit = parse_memory(memory_limit) if memory_limit else None
    settings = TrialSettings(warmup_steps=warmup, measure_steps=steps, seed=seed, timeout=timeout, device=device,
                             memory_limit=limit)
    fingerprint = hardware_fingerprint(profile)
    storage = storage if storage is not None else default_storage()
    check_storage(storage)
    name = study_name_for(path, script_args, fingerprint)
    out_path = out or config_path_for(path)
    progress_console = Console(stderr=True) if json_output else console
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=progress_console) as bar:
        # The budget plus the reference; a search that stops early completes the bar.
        task = bar.add_task("starting", total=trials + 1)
        count = {"n": 0}

        def on_start(label: str) -> None:
            count["n"] += 1
            bar.update(task, description=f"trial {count['n']}: {label}")

        def on_done(label: str, ev: Any, m: Any) -> None:
            bar.advance(task)
            style = VERDICT_STYLE.get(m.outcome, "red")
            speed = f", {ev.speedup:.2f}x fp32" if ev is not None and ev.speedup else ""
            bar.console.print(f"  {label}: [{style}]{m.outcome}[/]{speed}", highlight=False)

        result = tune_policy(
            ScriptRunner(path, script_args, settings,
                         wait_idle_on=profile if os.environ.get(WAIT_IDLE_ENV) else None), profile, trials=trials, time_budget=time_budget,
            scale_batch=scale_batch, include_emulated=include_emulated, modes=modes or None, memory_limit=limit,
            storage=storage, study_name=name, resume=resume, seed=seed, workload={"script": str(path)},
            use_priors=use_priors,
            on_start=on_start, on_done=on_done,
        )
    written = None
    cache_id = None
    if result.policy is not None:
        written = result.policy.save(out_path)
        if cache:
            cache_id = _remember(result, profile, path)
    if json_output:
        payload = result.to_dict()
        payload.update(script=str(path), args=script_args, config_file=str(written) if written else None,
                       cache_id=cache_id, storage=storage, study_name=name,
                       hardware={"name": profile.name, "fingerprint": fingerprint})
        sys.stdout.write(json.dumps(payload, indent=2, default=str) + "\n")
    else:
        render_tune(console, result, path, profile.name, written, cache_id, storage, name)
    return EXIT_FOUND if result.policy is not None else EXIT_NONE_STABLE


def _remember(result: TuneResult, profile: Any, script: Path) -> int | None:
    from advisor.cache._recommend import record_tune

    assert result.policy is not None and result.policy.tuned_on is not None
    rows = []
    for number, (cand, m) in enumerate(result.ranking()):
        rows.append({
            "number": number, "mode": cand.mode, "params": cand.params(), "outcome": m.outcome or "ok",
            "verdict": "stable" if m.stable else "not stable", "reason": m.reason, "goodput": m.goodput,
            "metrics": {"feasible": m.feasible, "label": cand.label},
        })
    workload = result.policy.tuned_on.workload_fingerprint
    if not workload:
        return None
    return record_tune(
        profile=profile, policy=result.policy, script=str(script), workload_fingerprint=workload, trials=rows,
        speedup_vs_fp32=result.winner_speedup, goodput=result.policy.tuned_on.goodput,
    )


def render_tune(console: Console, result: TuneResult, script: Path, device: str, written: Path | None,
                cache_id: int | None, storage: str | None, study_name: str) -> None:
    """Results table ranked by goodput, the winner, and the line to add to the script."""
    ref = result.reference.goodput or 0.0
    table = Table(title=f"{script.name} on {device}: the fp32 reference and {result.search.runs} trials"
                  + (f", {result.search.resumed} resumed" if result.search.resumed else "")
                  + f" of {len(result.space.grid())} candidates", title_justify="left")
    for col, justify in (("", "left"), ("candidate", "left"), ("samples/s", "right"), ("vs fp32", "right"),
                         ("peak memory", "right"), ("verdict", "left")):
        table.add_column(col, justify=justify, no_wrap=True)
    for cand, m in result.ranking():
        ev = result.evaluations.get(cand)
        mark = "→" if cand == result.winner else ""
        style = VERDICT_STYLE.get(m.outcome or "ok", "red")
        table.add_row(mark, cand.label, f"{m.goodput:,.0f}" if m.goodput else "-",
                      f"{m.goodput / ref:.2f}x" if ref and m.goodput else "-",
                      fmt_bytes(ev.result.peak_memory) if ev else "-", f"[{style}]{m.outcome or 'ok'}[/]")
    console.print(table)
    for cand, m in result.ranking():
        if not (m.stable and m.feasible) and m.reason:
            console.print(f"[{VERDICT_STYLE.get(m.outcome, 'red')}]{cand.label}[/]: {m.reason}", highlight=False)
    ratios = ", ".join(f"{k} {v:.2g}x" for k, v in result.dtype_ratio.items() if k != "fp32")
    if ratios:
        console.print(f"matmul throughput vs fp32 on this device (the search's priors): {ratios}", highlight=False)
    console.print(f"search stopped: {result.search.stop_reason}", highlight=False)
    if result.finalists and len(result.finalists) > 1:
        close = ", ".join(f"{f.candidate.label} {f.goodput:,.0f}/s" for f in result.finalists)
        console.print(f"re-measured side by side: {close}", highlight=False)
    if result.tie_note:
        console.print(f"tie: {result.tie_note}", highlight=False)
    if result.policy is None:
        console.print("[bold red]no stable policy fits[/]: every candidate was unstable, out of memory or failed")
        return
    speed = result.winner_speedup
    console.print(f"[bold green]winner[/]: {result.policy.describe()}"
                  + (f", {speed:.2f}x fp32 goodput" if speed else ""), highlight=False)
    if result.scale_batch_note:
        console.print(f"[yellow]note[/]: {result.scale_batch_note}", highlight=False)
    if written:
        console.print(f"wrote {written}", highlight=False)
    if cache_id is not None:
        console.print(f"cached for this GPU/CPU as entry #{cache_id} (mpadvise show)", highlight=False)
    if storage:
        console.print(f"study {study_name!r} in {storage} (continue with --resume)", highlight=False)
    console.print("add to the script: [bold]mp = advisor.load_policy()[/] (it reads the config file beside it)")
