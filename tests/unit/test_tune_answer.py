"""The default report of a tune is the answer at a glance: at most 15 lines at 80 columns, one
line per table row (none wraps), each failing mode once with one word for why, a machine note
only where it made the figure rough; ``--verbose`` keeps every figure. Built from a tune's JSON,
recorded from a fake tune, as the command line renders it."""

from __future__ import annotations

import copy
import io
import re

from rich.console import Console
from test_tables_80_columns import _tune_json

from advisor.cli._report import answer_rows, render_tune, short_label, why_word
from advisor.cli._report_cells import fmt_bytes

NAN_REASON = "fp16-mixed is unstable: its loss went nan at step 11 (the loss scale could not keep it finite)"


def _lines(tune: dict, *, width: int = 80, **kwargs) -> list[str]:
    console = Console(record=True, width=width, file=io.StringIO())
    render_tune(tune, console, **kwargs)
    return console.export_text().splitlines()


def _demo() -> dict:
    """A tune with a winner, runners-up, fp32, three fp16 variants unstable for one reason, an
    fp8 one out of memory, and every detail the whole report shows."""
    tune = _tune_json()
    template = next(row for row in tune["candidates"] if row.get("winner"))
    rows = [row for row in tune["candidates"] if row.get("outcome") == "ok" and "#" not in row["label"]]
    for scale in ("2^16", "2^12", "2^8"):
        rows.append({**template, "label": f"fp16-mixed dynamic {scale} growth 2000 reduce-bf16 mb256",
                     "mode": "fp16-mixed", "outcome": "unstable", "stable": False, "winner": False,
                     "goodput": 15000.0, "speedup_vs_fp32": 2.34, "search_speedup_vs_fp32": 2.34,
                     "reason": NAN_REASON})
    rows.append({**template, "label": "fp8-torchao tensorwise mb256", "mode": "fp8-torchao", "outcome": "oom",
                 "stable": False, "feasible": False, "winner": False, "goodput": None, "reason": "oom: CUDA out of memory"})
    tune["candidates"] = rows
    tune.update(config_file="/work/proj/train_language_model.mpadvise.toml", cache_id=7, calls_load_policy=True,
                study_name="train-abc-123", storage="sqlite:////home/someone/.cache/mpadvise/studies.db",
                cost={"trials": 6, "wall_s": 50.0, "trial_equivalents": 100, "window_s": 0.5})
    return tune


def test_the_default_report_fits_15_lines_at_80_columns_and_no_row_wraps():
    tune = _demo()
    lines = _lines(tune, already_tuned="2026-12-07 09:40")
    assert len(lines) <= 15, "\n".join(lines)
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert lines[0].startswith("winner: bf16, 2.00x fp32 goodput"), lines[0]
    shown = answer_rows(tune)
    table = [line for line in lines if re.match(r"^[→ ] │ ", line)]
    assert len(table) == len(shown) + 1, "\n".join(lines)  # the header and one line per row: none wraps
    assert all("…" not in line for line in table), "\n".join(table)
    assert lines[-1] == "already tuned 2026-12-07 09:40: mpadvise tune --fresh to tune again"
    assert any(line.startswith("config: ") and "(cached, entry #7)" in line for line in lines)
    assert any(line.startswith("next: ") for line in lines)
    # Nothing of the whole report: no priors, stop reason, spread, FLOPs, cost, study.
    text = "\n".join(lines)
    for detail in ("search stopped", "FLOPs per step", "run-to-run", "cost:", "matmul throughput", "study '",
                   "continue with", "python -m"):
        assert detail not in text, detail


def test_a_diagnosis_shared_by_several_variants_shows_once():
    tune = _demo()
    lines = _lines(tune)
    fp16 = [line for line in lines if "fp16" in line]
    assert len(fp16) == 1 and fp16[0].rstrip().endswith("│ nan") and "fp16 dyn 2^16" in fp16[0], "\n".join(lines)
    assert sum("oom" in line for line in lines) == 1
    verbose = "\n".join(_lines(tune, width=500, verbose=True))
    assert verbose.count(NAN_REASON) == 1, verbose
    assert "fp16-mixed dynamic 2^16 growth 2000 reduce-bf16 mb256, fp16-mixed dynamic 2^12" in verbose


def test_the_machine_note_shows_once_and_only_when_the_figure_is_rough():
    tune = _demo()
    assert not any(line.startswith("note:") for line in _lines(tune))
    noisy = copy.deepcopy(tune)
    for row in noisy["candidates"]:
        row["step_time_p90"] = row["step_time_p10"] * 2.2  # ±60%
    notes = [line for line in _lines(noisy) if line.startswith("note:")]
    assert len(notes) == 1 and "noisy" in notes[0], notes


def test_the_verbose_report_keeps_every_figure():
    tune = _demo()
    text = "\n".join(_lines(tune, width=200, verbose=True))
    for row in tune["candidates"]:
        if row.get("goodput"):
            assert f"{row['goodput']:,.0f}" in text, row["label"]
        assert fmt_bytes(row.get("peak_memory")) in text
    assert "FLOPs per step 3e+12" in text and "probed TFLOP/s: fp32 60, bf16 990" in text
    assert "MFU of every row is of one peak, the probed bf16 matmul peak (990 TFLOP/s" in text
    assert "cost: 6 trials in 50 s, 100 measured windows of 0.5 s" in text
    assert "search stopped: " in text and "matmul throughput vs fp32" in text
    assert "study 'train-abc-123' in sqlite:////home/someone/.cache/mpadvise/studies.db" in text
    assert "continue with: mpadvise tune " in text
    assert "run-to-run spread" in text or not tune.get("replicate")


def test_short_labels_and_one_word_reasons():
    assert short_label("fp16-mixed dynamic 2^16") == "fp16 dyn 2^16"
    assert short_label("fp16-mixed dynamic 2^16 growth 2000 reduce-bf16 mb256") == "fp16 dyn 2^16 g2000 rbf16 mb256"
    assert short_label("bf16-mixed mb32") == "bf16 mb32"
    assert why_word({"outcome": "unstable", "reason": NAN_REASON}) == "nan"
    assert why_word({"outcome": "unstable", "reason": "its loss fell 40% as far as fp32's (limit 90%)"}) == "stalled"
    assert why_word({"outcome": "crash", "reason": "exit 1"}) == "crash"
