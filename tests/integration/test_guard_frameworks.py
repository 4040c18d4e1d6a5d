"""The guard over Lightning, Accelerate and Hugging Face Trainer scripts under ``mpadvise run``.

Their steps reach the guard at torch's own seams (``Tensor.backward``, ``GradScaler.scale`` and
``step``, the optimizer step hooks), whichever framework drives the loop. None of them can
change precision in place, so under ``warn`` and ``fallback`` alike the one line asks for a
restart; the event is cached, ``mpadvise show`` lists it, and the next ``mpadvise run`` applies
the safer mode and finishes with a finite loss. The Trainer takes fp16 on a GPU only, so on a
CPU its script goes wrong under bf16-mixed and the run moves to fp32.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from policies import Policy

SCRIPTS = Path(__file__).resolve().parent / "scripts"
STEPS, ONSET = 80, 40
# framework -> (script, the mode it runs, the mode the guard moves it to, the 16-bit dtype seen)
CASES = {
    "accelerate": ("accelerate_late_overflow.py", "fp16-mixed", "bf16-mixed", "torch.float16"),
    "lightning": ("lightning_late_overflow.py", "fp16-mixed", "bf16-mixed", "torch.float16"),
    "hf": ("hf_late_overflow.py", "bf16-mixed", "fp32", "torch.bfloat16"),
}


def _result(proc) -> dict:
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _guard_lines(stderr: str) -> list[str]:
    return [line[line.index("mpadvise: guard:"):] for line in stderr.splitlines() if "mpadvise: guard:" in line]


def _watched_then_safer(tmp_path: Path, cli, framework: str, setting: str) -> None:
    name, mode, safer, dtype = CASES[framework]
    script = tmp_path / name
    shutil.copy(SCRIPTS / name, script)
    Policy(mode=mode).save(script.with_name(script.stem + ".mpadvise.toml"))
    args = ("--", str(STEPS), str(ONSET))

    first = cli("run", "--guard", setting, str(script), *args, timeout=300)
    assert _result(first)["dtype"] == dtype, first.stderr
    (line,) = _guard_lines(first.stderr)
    assert f"guard: non-finite loss under {mode} (began at optimizer step" in line, line
    onset = int(line.split("began at optimizer step ")[1].split(",")[0].split(";")[0])
    assert ONSET <= onset <= ONSET + 3, line
    assert "restart the run" in line and safer in line, line

    shown = cli("show", "--json", timeout=120)
    assert shown.returncode == 0, shown.stderr
    (row,) = json.loads(shown.stdout)["guard_events"]
    assert (row["policy"], row["fallback"], row["action"]) == (mode, safer, "restart needed")
    assert row["step"] == onset and row["script"] == str(script.resolve())

    again = cli("run", str(script), *args, timeout=300)
    second = _result(again)
    assert math.isfinite(second["final_loss"]) and second["steps"] == STEPS, again.stderr
    assert f"applying {safer} rather than {mode}" in again.stderr
    assert not _guard_lines(again.stderr)


@pytest.mark.parametrize("setting", ["warn", "fallback"])
def test_an_accelerate_script_is_watched_and_the_next_run_applies_the_safer_mode(tmp_path, isolated_home, cli,
                                                                                  setting):
    _watched_then_safer(tmp_path, cli, "accelerate", setting)


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["lightning", "hf"])
def test_a_framework_script_is_watched_and_the_next_run_applies_the_safer_mode(tmp_path, isolated_home, cli,
                                                                                framework):
    _watched_then_safer(tmp_path, cli, framework, "warn")


def test_the_trainer_refuses_fp16_on_a_cpu_in_one_line(tmp_path, isolated_home, cli):
    script = tmp_path / "hf_late_overflow.py"
    shutil.copy(SCRIPTS / "hf_late_overflow.py", script)
    config = Policy(mode="fp16-mixed").save(tmp_path / "fp16.mpadvise.toml")
    proc = cli("run", "--config", str(config), str(script), "--", str(STEPS), str(ONSET), timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "transformers applies fp16-mixed on CUDA only" in proc.stderr.strip().splitlines()[-1]
