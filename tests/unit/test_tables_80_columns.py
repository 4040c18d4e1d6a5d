"""Every table the command line prints fits an 80-column terminal: no header or cell that must be
read whole is cut to an ellipsis, and no column is dropped, with long device names, long candidate
labels and every outcome word."""

from __future__ import annotations

import functools
import io
import json
import math

import pytest
from rich.console import Console

from advisor.cli._cache import render_list, render_record, render_show
from advisor.cli._env import render_probe
from advisor.cli._report import evaluation_table, print_reasons, render_tune
from advisor.trial import TrialResult
from advisor.tune import TuneOptions
from advisor.tune._engine import tune_policy
from advisor.tune._judge import evaluate
from policies import Policy
from probes import HardwareProfile

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

LONG_DEVICE = "NVIDIA H100 80GB HBM3 MIG 7g.80gb (Hopper, PCIe Gen5, 700 W board)"
OUTCOMES = ("ok", "unstable", "too-short", "oom", "crash", "timeout", "unsupported", "no-step", "no-policy", "lost",
            "pruned")
LONG_LABELS = ("fp16-mixed mb3 dynamic", "fp16-mixed static 2^12 reduce-bf16 mb256", "fp8-torchao mb16 tensorwise")


def _text(render, *args, width: int = 80) -> str:
    console = Console(record=True, width=width, file=io.StringIO())
    render(*args, console)
    return console.export_text()


def _assert_fits(text: str, *, must_appear: tuple[str, ...]) -> None:
    for line in text.splitlines():
        assert len(line) <= 80, f"wider than 80 columns: {line!r}"
    assert "…" not in text, f"a cell or header is cut:\n{text}"
    words = set(text.split())
    for item in must_appear:
        # A label may wrap at its spaces; none of its words may break.
        missing = [word for word in item.split() if word not in words and word not in text]
        assert not missing, f"{item!r} not whole at 80 columns ({missing}):\n{text}"


# -- the tune table -------------------------------------------------------------------------------------


def _trial(policy: Policy, label: str) -> TrialResult:
    steps = 40
    losses = [2.0 * math.exp(-i / 20) for i in range(steps)]
    if policy.mode == "fp16-mixed":
        losses = losses[:10] + [float("nan")] * (steps - 10)
    ms = {"fp32": 10.0, "bf16-mixed": 5.0}.get(policy.mode, 4.0)
    return TrialResult(
        outcome="ok", label=label, policy=policy.to_dict(), losses=tuple(losses), step_times=(ms / 1e3,) * steps,
        samples=(64,) * steps, skipped=(False,) * steps, warmup_steps=3, user_batch=64, global_batch=64,
        peak_memory=300 * 2**20, workload_fingerprint="ab" * 8, model_signature="cd" * 8,
    )


def _tune_json() -> dict:
    profile = HardwareProfile(kind="cuda", name=LONG_DEVICE, index=0, compute_capability=(9, 0),
                              memory_total=80 * 2**30, torch_version="2.13.0")
    options = TuneOptions(trials=4, modes=["bf16-mixed", "fp16-mixed"], no_priors=True)
    result = tune_policy(_trial, profile, options, dtype_ratio={"fp32": 1.0, "bf16": 12.0}, remeasure=False)
    tune = json.loads(json.dumps(result.to_dict(), default=str))
    tune.update(script="/home/someone/projects/a-rather-long-project-name/train_language_model.py", args=[],
                hardware={"name": LONG_DEVICE}, flops_per_step=3e12, peak_tflops={"fp32": 60.0, "bf16": 990.0})
    template = tune["candidates"][0]
    extra = []
    for i, outcome in enumerate(OUTCOMES[:-1]):
        extra.append({**template, "label": f"{LONG_LABELS[i % 3]} #{i}", "outcome": outcome, "winner": False,
                      "stable": outcome == "ok", "goodput": 123456.7 if outcome in ("ok", "unstable") else None,
                      "search_speedup_vs_fp32": 50.1312, "speedup_vs_fp32": 50.1312, "tflops": 123.456,
                      "mfu": 0.1234, "peak_memory": 79 * 2**30,
                      "reason": f"{outcome}: a long reason that says in plain words why this candidate lost"})
    tune["candidates"] += extra
    tune["pruned"] = [{"label": "fp8-te mb256", "mode": "fp8-te", "outcome": "pruned",
                       "reason": "the matmul priors say it cannot win"}]
    return tune


def test_the_tune_table_fits_80_columns_with_every_outcome_and_long_labels():
    tune = _tune_json()
    text = _text(render_verbose, tune)
    table = text.split("FLOPs per step")[0]
    _assert_fits(table, must_appear=(*OUTCOMES[:-1], "pruned", *LONG_LABELS, "123,457", "50.13x", "79.00 GiB"))


def test_the_tune_table_shows_every_column_header_whole():
    text = _text(render_verbose, _tune_json())
    header = next(line for line in text.splitlines() if "│ candidate" in line)
    for word in ("goodput", "×fp32", "TF/s", "MFU", "memory", "verdict"):
        assert word in header, header


# -- the trial table --------------------------------------------------------------------------------------


def _evaluations() -> tuple:
    reference = _trial(Policy(mode="fp32"), "fp32")
    ref = evaluate("fp32", Policy(mode="fp32"), reference, reference)
    evaluations = []
    for i, outcome in enumerate(("ok", "unstable", "oom", "crash", "timeout", "unsupported", "no-step", "lost")):
        label = f"{LONG_LABELS[i % 3]} #{i}"
        policy = Policy(mode="bf16-mixed" if outcome == "ok" else "fp16-mixed")
        result = _trial(policy, label)
        if outcome not in ("ok", "unstable"):
            result = result.with_outcome(outcome, f"{outcome}: the child said so at some length, in words")
        evaluations.append(evaluate(label, policy, result, reference))
    return ref, evaluations


def test_the_trial_table_fits_80_columns_and_keeps_the_verdict_column():
    ref, evaluations = _evaluations()
    text = _text(lambda c: c.print(evaluation_table(ref, evaluations, title=f"train.py on {LONG_DEVICE}")))
    _assert_fits(text, must_appear=("verdict", "goodput", "unstable", "oom", "crash", "timeout", "unsupported",
                                    "no-step", "lost", *LONG_LABELS, "300 MiB"))


def test_the_trial_reasons_go_under_the_table_wrapped_to_the_terminal():
    _, evaluations = _evaluations()
    text = _text(lambda c: print_reasons(c, evaluations))
    assert all(len(line) <= 80 for line in text.splitlines())
    assert "the child said so at some length" in text.replace("\n", " ")


# -- the cache tables -------------------------------------------------------------------------------------


def _summary(i: int, label: str) -> dict:
    return {"id": 1000 + i, "hardware_fp": "f" * 16, "device": LONG_DEVICE, "workload_fp": "ab" * 8,
            "script": "/a/long/path/to/train_language_model_with_a_long_name.py",
            "script_name": "train_language_model_with_a_long_name.py", "mode": label, "policy": {},
            "speedup_vs_fp32": 50.1312, "goodput": 1e5, "created_at": "2026-11-30T12:00:00",
            "tuned": "2026-11-30", "versions": {}, "args": [["--epochs", "300", "--data", "./d"], [], None][i % 3]}


def test_cache_list_fits_80_columns_and_keeps_the_device_on_few_lines():
    report = {"database": "/home/someone/.cache/mpadvise/cache.db", "cache": True,
              "recommendations": [_summary(i, label) for i, label in enumerate(LONG_LABELS)]}
    text = _text(render_list, report)
    _assert_fits(text, must_appear=("2026-11-30", "50.13x", "abababab", "1000", *LONG_LABELS, "args", "×fp32",
                                    "--epochs", "./d"))
    assert "the winner's speed-up over fp32" in " ".join(text.split())


def test_mpadvise_show_fits_80_columns():
    rows = []
    for i, label in enumerate(LONG_LABELS):
        row = _summary(i, label)
        row.update(this_machine=i != 2, valid=i == 0,
                   status="valid" if i == 0 else "torch changed: tuned with 2.3.0, this is 2.13.0 (tune again)")
        rows.append(row)
    report = {"database": "/c/cache.db", "cache": True, "hardware": [{"fingerprint": "f" * 16, "device": LONG_DEVICE}],
              "recommendations": rows, "other_hardware": 1}
    text = _text(render_show, report)
    _assert_fits(text, must_appear=("valid", "2026-11-30", "50.13x", *LONG_LABELS, "args", "×fp32", "--epochs",
                                    "./d"))
    assert "the winner's speed-up over fp32" in " ".join(text.split())


def test_show_tells_two_tunes_of_one_script_apart_by_their_arguments():
    rows = []
    for i, args in enumerate(([], ["300"])):
        row = _summary(i, "fp32")
        row.update(script_name="tiny.py", args=args, workload_fp=("ab" if i else "cd") * 8, this_machine=True,
                   valid=True, status="valid")
        rows.append(row)
    report = {"database": "/c/cache.db", "cache": True, "hardware": [{"fingerprint": "f" * 16, "device": "CPU"}],
              "recommendations": rows, "other_hardware": 0}
    lines = [line for line in _text(render_show, report).splitlines() if "tiny.py" in line]
    assert len(lines) == 2 and len(set(lines)) == 2
    assert "tiny.py 300" in lines[1] and "300" not in lines[0]


def test_cache_show_fits_80_columns():
    record = {"id": 7, "hardware_fp": "f" * 64, "workload_fp": "a" * 64, "script": "/a/train.py", "policy": {},
              "mode": "fp16-mixed", "hardware": {"name": LONG_DEVICE}, "summary": {"args": ["--epochs", "3"]},
              "speedup_vs_fp32": 1.5,
              "goodput": 1234.5, "created_at": "2026-11-30T12:00:00", "versions": {"torch": "2.13.0"},
              "trials": [{"number": i, "mode": label, "outcome": outcome, "verdict": outcome,
                          "goodput": 123456.7, "reason": "a long reason " * 6}
                         for i, (label, outcome) in enumerate(zip(LONG_LABELS * 4, OUTCOMES, strict=False))]}
    record["policy"] = {"mode": "fp16-mixed", "tuned_on": {"speedup_low": 1.41, "speedup_high": 1.62,
                                                           "speedup_basis": "paired re-measurement, 4 pairs"}}
    text = _text(render_record, record)
    _assert_fits(text, must_appear=("goodput", "verdict", "123456.7", *OUTCOMES[:10], "--epochs 3"))
    for words in ("1.50x,", "the winner's speed-up over fp32", "(interval 1.41x-1.62x;", "paired re-measurement, 4 pairs)"):
        assert all(word in text.split() for word in words.split()), (words, text)


# -- the probe tables -------------------------------------------------------------------------------------


def test_the_probe_tables_fit_80_columns():
    from advisor._hardware import probe_report

    report = probe_report(bench=False)
    device = report["devices"][0]
    device["profile"]["name"] = LONG_DEVICE
    device["bench"] = [
        {"dtype": "fp8-e4m3", "size": 8192, "tflops": None, "skipped": "torch._scaled_mm is missing in this build"},
        {"dtype": "bf16", "size": 8192, "tflops": 123.456, "ratio_vs_fp32": 12.3, "fraction_of_peak": 0.61},
    ]
    text = _text(render_probe, report)
    _assert_fits(text, must_appear=("mode", "supported", "fp8-torchao", "bf16-mixed", "TFLOP/s", "of peak", "skipped"))


@pytest.mark.parametrize("width", [80, 200])
def test_no_table_line_is_wider_than_the_terminal(width):
    text = _text(render_verbose, _tune_json(), width=width)
    assert all(len(line) <= width for line in text.splitlines())



def test_a_noisy_speed_up_shows_its_spread_and_a_warning():
    tune = _tune_json()
    tune["speedup"] = {"ratio": 50.13, "low": 5.0, "high": 95.0, "pairs": 2, "confidence": 0.95,
                       "basis": "paired re-measurement"}
    tune["speedup_vs_fp32"] = 50.13
    text = _text(render_verbose, tune)
    winner = next(line for line in text.splitlines() if line.startswith("→"))
    assert "50.13x† ±90%" in winner
    assert "noisy timings: bf16-mixed ±90%" in " ".join(text.split())
    quiet = _text(render_verbose, _tune_json())
    assert "noisy timings" not in quiet and "1.00x ±0%" in quiet  # fp32's own quartiles


def test_progress_goes_to_stderr_and_leaves_stdout_to_the_result(capsys):
    from advisor.cli._report import trial_progress, tune_progress

    ref, evaluations = _evaluations()
    with tune_progress(Console(), 2) as (on_start, on_done, _):
        on_start("bf16-mixed")
        on_done("bf16-mixed", evaluations[0], evaluations[0])
    with trial_progress(Console(), 2) as (on_start, on_done):
        on_start(0, "fp32")
        on_done(0, ref)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "bf16-mixed: ok" in captured.err and "fp32: ok" in captured.err


# -- the other commands' tables ----------------------------------------------------------------------------


def test_the_study_status_table_fits_80_columns():
    from advisor.cli._cache import render_studies

    studies = [{"study": "train_language_model-3f2a9c1d", "hardware": LONG_DEVICE,
                "trials": {"complete": 120, "running": 3, "waiting": 0, "failed": 12},
                "workers": ["node-a.cluster.example.org", "node-b.cluster.example.org"],
                "best": {"label": LONG_LABELS[1], "goodput": 123456.7}}]
    report = {"storage": "postgresql://tuner:****@db.example.org:5432/studies", "studies": studies}
    _assert_fits(_text(render_studies, report), must_appear=("done", "run", "wait", "fail", "120", "12",
                                                     "123,456.7"))


def test_the_daemon_status_tables_fit_80_columns():
    from advisor.cli._daemon import render_status

    report = {"where": "127.0.0.1:8765", "health": {
        "version": "0.1.0", "pid": 4242, "uptime_s": 90061, "jobs": {"queued": 2, "running": 1},
        "slots": [{"name": "cuda:0", "job": "0123456789abcdef", "phase": "waiting for the GPU to be idle"}]},
        "jobs": [{"id": "0123456789abcdef", "state": "running", "script": "/w/train_language_model.py",
                  "gpu": "cuda:0", "created_at": "2026-11-30T12:00:00.000000+00:00",
                  "result": {"tune": {"winner_label": LONG_LABELS[1], "speedup_vs_fp32": 50.13}}}]}
    text = _text(render_status, report)
    _assert_fits(text, must_appear=("slot", "doing", "state", "created", "running", "cuda:0", "0123456789ab"))


def test_the_trial_breakdown_fits_80_columns():
    from advisor.cli._trial import breakdown_table

    rows = [(label, _trial(Policy(mode="fp32"), label)) for label in ("fp32", "fp32 replicate", *LONG_LABELS)]
    text = _text(lambda c: c.print(breakdown_table(rows, 3e5)))
    _assert_fits(text, must_appear=("trial", "TFLOP/s", *LONG_LABELS))
