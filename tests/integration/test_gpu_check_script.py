"""scripts/gpu_check.sh's step control, run on the CPU (--dry-run) with this interpreter: --only
and --skip, the summary rewritten as each step starts and ends, the commit it names, a budget
that leaves a step "not reached", and a TERM in the middle of a step, which keeps a summary and
every trial finished so far. Nothing here stands in for a GPU result: the dry run's rows say
they come from a CPU."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "scripts" / "gpu_check.sh"
FILES = {"summary.txt", "env.txt", "log.txt", "tests.txt", "probe.json", "trial.json", "lm.json", "tune.json"}


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("MPADVISE_TRIAL_STREAM", None)
    env.update({"PYTHON": sys.executable, "OUT": str(tmp_path / "out"), "MPADVISE_GPU_SITE": str(tmp_path / "site"),
                "MPADVISE_GPU_CHECK_SCALE": "4", "MPADVISE_SOURCE": "0123abc", "TMPDIR": str(tmp_path), **extra})
    return env


def _check(tmp_path: Path, *args: str, timeout: float = 600, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True, timeout=timeout,
                          env=_env(tmp_path, **extra), cwd=ROOT)


def _rows(summary: str) -> list[str]:
    """The step names of the summary's rows (name, exit code or -, seconds; the verdict lines
    under a step are indented)."""
    return re.findall(r"^([a-z][a-z0-9-]*) +(?:-|\d+) +\d+  ", summary, flags=re.MULTILINE)


@pytest.mark.parametrize("args", [["--only", "trial,nope"], ["--skip=nope"], ["--only"], ["--frobnicate"]])
def test_a_wrong_argument_is_one_line_and_exit_2_before_anything_runs(tmp_path, args):
    proc = _check(tmp_path, "--dry-run", *args, timeout=60)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
    if "nope" in " ".join(args):
        assert "unknown step 'nope'" in proc.stderr and "tune" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_only_runs_the_named_step_and_the_summary_names_the_commit(tmp_path):
    proc = _check(tmp_path, "--dry-run", "--skip", "wheels", "--only", "imports")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stderr
    assert _rows(summary) == ["cpu", "imports"]
    assert "source 0123abc;" in summary and summary.rstrip().endswith("PASS")
    assert {p.name for p in (tmp_path / "out").iterdir()} <= FILES


@pytest.mark.slow
def test_a_step_the_budget_cannot_hold_is_not_reached_and_the_summary_says_how_to_finish(tmp_path):
    proc = _check(tmp_path, "--dry-run", "--skip", "wheels", "--only", "imports,tests",
                  MPADVISE_GPU_CHECK_BUDGET="1")
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert proc.returncode == 1, summary
    assert _rows(summary) == ["cpu", "imports", "tests"]
    assert "not reached: imports tests; finish with: scripts/gpu_check.sh --dry-run --only imports,tests" in summary


def _interruptible() -> None:
    """In the check's process, before bash starts: SIGINT back to its default. A test run started
    in the background (`cmd &` in a script, as CI runners may) inherits SIGINT ignored, and a
    shell cannot trap a signal ignored on entry, so the check would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stop_when(proc: subprocess.Popen, ready, what: str, limit: float = 600) -> None:
    deadline = time.monotonic() + limit
    while not ready():
        if proc.poll() is not None:
            raise AssertionError(f"the check ended ({proc.returncode}) before {what}: {proc.stdout.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"no {what} within {limit} s")
        time.sleep(0.5)


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (this test's own trial stream path)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return found


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_check_stopped_in_the_middle_of_a_trial_keeps_a_summary_and_every_finished_trial(tmp_path):
    out = tmp_path / "out"
    stream = out / "trial.json"
    proc = subprocess.Popen(["bash", str(CHECK), "--dry-run", "--skip", "wheels", "--only", "trial"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(tmp_path), cwd=ROOT)
    try:
        # The reference has finished (its line is in the stream); the replicate or a candidate runs.
        _stop_when(proc, lambda: stream.exists() and stream.read_text().count("\n") >= 1, "a finished trial")
        running = (out / "summary.txt").read_text()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    summary = (out / "summary.txt").read_text()
    assert "RUNNING: trial" in running and _rows(running) == ["cpu", "probe"]  # written as the step began
    assert proc.returncode == 143, summary
    assert _rows(summary) == ["cpu", "probe", "trial"]
    assert "STOPPED by SIGTERM; FAIL: trial" in summary
    trial_row = next(line for line in summary.splitlines() if line.startswith("trial "))
    assert "stopped by SIGTERM" in trial_row
    assert any(line.split()[:2] == ["fp32", "ok"] for line in summary.splitlines())  # the finished reference
    assert "did not finish" in summary
    lines = [json.loads(line) for line in stream.read_text().splitlines()]
    assert lines[0]["event"] == "trial" and lines[0]["role"] == "reference" and lines[0]["outcome"] == "ok"
    assert {p.name for p in out.iterdir()} <= FILES
    time.sleep(2)
    assert _processes_with(f"MPADVISE_TRIAL_STREAM={stream}") == []  # the trial and its children ended


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_only_tune_runs_the_tune_alone(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen(["bash", str(CHECK), "--dry-run", "--skip", "wheels", "--only", "tune"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(tmp_path), cwd=ROOT, preexec_fn=_interruptible)
    try:
        summary = out / "summary.txt"
        _stop_when(proc, lambda: summary.exists() and "RUNNING: tune" in summary.read_text(), "the tune")
        running = summary.read_text()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    # The probe runs for the tune's modes; no other step does.
    assert _rows(running) == ["cpu", "probe"] and "run for the modes of: tune" in running
    final = summary.read_text()
    assert proc.returncode == 130 and _rows(final) == ["cpu", "probe", "tune"]
    assert "STOPPED by SIGINT" in final
    assert {p.name for p in out.iterdir()} <= FILES


def _helpers(tmp_path: Path) -> Path:
    """The check's own Python (the heredoc in gpu_check.sh), as a file."""
    text = CHECK.read_text()
    start = text.index("cat > \"$WORK/check.py\" <<'PY'\n") + len("cat > \"$WORK/check.py\" <<'PY'\n")
    path = tmp_path / "check.py"
    path.write_text(text[start:text.index("\nPY\n", start)] + "\n")
    return path


def _trial_line(index: int, role: str, mode: str, median: float) -> str:
    return json.dumps({"event": "trial", "index": index, "role": role, "label": mode, "mode": mode, "outcome": "ok",
                       "exit_code": 0, "global_batch": 8, "step_time": {"median": median}})


@pytest.mark.slow
def test_the_lm_report_gives_speed_ups_and_the_fraction_of_the_datasheet_peak(tmp_path):
    # Made-up step times on a made-up probe of an H200: the arithmetic of the report, not a result.
    stream = tmp_path / "lm.json"
    stream.write_text("\n".join([_trial_line(0, "reference", "fp32", 0.4), _trial_line(1, "replicate", "fp32", 0.4),
                                 _trial_line(2, "candidate", "bf16-mixed", 0.04),
                                 _trial_line(3, "candidate", "fp8-torchao", 0.032)]) + "\n{\"event\": \"tr")
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"devices": [{"profile": {"kind": "cuda"},
                                              "peak_tflops": {"fp32": 66.9, "bf16": 989.4, "fp8": 1978.9}}]}))
    sizes = ["--width", "2048", "--layers", "4", "--heads", "16", "--context", "1024", "--vocab", "4096", "--batch-size", "8"]
    proc = subprocess.run([sys.executable, str(_helpers(tmp_path)), "lm", str(stream), str(probe), "cuda", *sizes],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt_lm import train_flops

    flops = train_flops(width=2048, layers=4, context=1024, vocab=4096, batch=8)
    rows = {line.split()[0]: line for line in proc.stdout.splitlines()[1:]}
    assert list(rows) == ["fp32", "bf16-mixed", "fp8-torchao"]  # the replicate is no mode of its own
    assert "10.00x fp32" in rows["bf16-mixed"] and " 1.00x bf16-mixed" in rows["bf16-mixed"]
    assert "12.50x fp32" in rows["fp8-torchao"] and " 1.25x bf16-mixed" in rows["fp8-torchao"]
    assert f"{flops / 0.04 / 1e12 / 989.4:6.1%} of the bf16 peak, 989.4" in rows["bf16-mixed"]
    assert f"{flops / 0.032 / 1e12 / 1978.9:6.1%} of the fp8 peak" in rows["fp8-torchao"]
    assert f"{flops / 0.4 / 1e12:.3g} TFLOP/s" in rows["fp32"]


def test_a_torch_probe_that_hangs_is_reported_as_timed_out(tmp_path):
    """Where nvidia-smi answers but importing torch or initialising CUDA hangs, the check stops
    with that reason, not an empty "torch sees no CUDA device ()"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: fake'\n")
    python = bin_dir / "python"
    # The probe's code is the only one that asks torch about CUDA: that one hangs.
    python.write_text(f'#!/bin/sh\ncase "$*" in *torch.cuda*) sleep 30;; esac\nexec {sys.executable} "$@"\n')
    for tool in (smi, python):
        tool.chmod(0o755)
    proc = _check(tmp_path, "--only", "imports", timeout=120, PYTHON=str(python),
                  PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", MPADVISE_GPU_PROBE_TIMEOUT="2")
    assert proc.returncode == 1
    assert "the torch probe (import torch, CUDA initialisation) timed out after 2 s" in proc.stderr
    assert "()" not in proc.stderr
