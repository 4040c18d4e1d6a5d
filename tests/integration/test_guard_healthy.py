"""A healthy run never trips the guard: each bundled example written against the Python API, each
plain PyTorch example and each framework example runs to its end under ``mpadvise run --guard
warn`` with fp16-mixed (a GradScaler for the guard to watch: its skips while it calibrates, its
scale) and says nothing. The HF Trainer takes fp16 on a GPU only, so it runs bf16-mixed here.
The sizes are cut so that fp16 on a CPU without an fp16 fast path stays quick.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from policies import Policy

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
CASES = {
    "mlp.py": ["--epochs", "1", "--width", "64"],
    "cnn.py": ["--epochs", "1", "--channels", "8"],
    "tiny_lm.py": ["--steps", "40", "--width", "32", "--context", "16"],
    "gpt_lm.py": ["--steps", "30", "--width", "64", "--layers", "1"],
    "plain_mlp.py": ["--epochs", "1", "--width", "64", "--samples", "1024"],
    "plain_gpt.py": ["--max_iters=40", "--dtype=float16"],
    "plain_manual.py": ["--steps", "60"],
    "lightning_mlp.py": ["--max-steps", "60", "--width", "64", "--samples", "2048"],
    "fabric_mlp.py": ["--max-steps", "60", "--width", "64", "--samples", "2048"],
    "accelerate_mlp.py": ["--steps", "60", "--width", "64", "--samples", "2048"],
    "hf_trainer.py": ["--steps", "40", "--width", "32", "--layers", "1", "--context", "16"],
}
# No optimizer to skip a step (plain_manual.py), or fp16 on a GPU only (the HF Trainer):
# bf16-mixed there.
BF16 = {"plain_manual.py", "hf_trainer.py"}


# Two examples, one of each way in, run in `make test`; the rest are in the slow set (each run is a
# fresh process that imports torch), with tests/unit/test_guard.py's healthy fp16 run beside them.
FAST = {"mlp.py", "plain_gpt.py"}


@pytest.mark.parametrize("example", [e if e in FAST else pytest.param(e, marks=pytest.mark.slow) for e in sorted(CASES)])
def test_a_healthy_run_of_an_example_trips_nothing(tmp_path, isolated_home, cli, example):
    script = tmp_path / example
    shutil.copy(EXAMPLES / example, script)
    mode = "bf16-mixed" if example in BF16 else "fp16-mixed"
    Policy(mode=mode).save(script.with_name(script.stem + ".mpadvise.toml"))
    proc = cli("run", "--guard", "warn", str(script), "--", *CASES[example], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert mode in proc.stderr  # the policy was applied, and named
    assert "guard:" not in proc.stderr, proc.stderr[-3000:]
