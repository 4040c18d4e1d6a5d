"""``mpadvise run --config FILE``: a config file that cannot be applied is a bad option value:
one line on stderr, exit 2, never a traceback, whatever is wrong with it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "scripts"

BAD_CONFIGS = {
    "not-toml": ("mode = fp32 [[\n", "invalid TOML"),
    "unknown-mode": ('mode = "fp99"\n', "'fp99'"),
    "no-mode": ('[loss_scale]\nkind = "dynamic"\n', "missing 'mode'"),
    "wrong-type": ('mode = "fp32"\nmicro_batch_size = "x"\n', "'x'"),
    # What other tools call a config: DeepSpeed's JSON, Accelerate's YAML.
    "deepspeed-json": ('{"bf16": {"enabled": true}, "train_micro_batch_size_per_gpu": 8}\n', "invalid TOML"),
    "accelerate-yaml": ("compute_environment: LOCAL_MACHINE\nmixed_precision: bf16\n", "invalid TOML"),
}


@pytest.fixture(params=["loop-api", "lightning"])
def script(request, tmp_path):
    """A loop-API script (it calls load_policy() itself) and a Lightning one (run through the adapter)."""
    name = "tiny_ok.py" if request.param == "loop-api" else "lightning_knobs.py"
    path = tmp_path / name
    shutil.copy(SCRIPTS / name, path)
    return path, ([] if request.param == "loop-api" else ["--framework", "lightning"])


def _one_error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    return lines[0]


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_a_bad_config_is_one_line_and_exit_2(case, script, tmp_path, isolated_home, cli):
    path, flags = script
    text, expected = BAD_CONFIGS[case]
    config = tmp_path / f"{case}.toml"
    config.write_text(text)
    os.chmod(config, 0o600)
    proc = cli("run", str(path), "--config", str(config), *flags, "--", "3", timeout=120)
    line = _one_error_line(proc.stderr)
    assert proc.returncode == 2, proc.stderr
    assert line.startswith("error: ") and str(config) in line and expected in line
    assert proc.stdout == ""  # the script never started


def test_a_missing_or_untrusted_config_is_exit_2_too(script, tmp_path, isolated_home, cli):
    path, flags = script
    missing = cli("run", str(path), "--config", str(tmp_path / "none.toml"), *flags, timeout=120)
    assert missing.returncode == 2
    assert _one_error_line(missing.stderr) == f"error: --config: config file {tmp_path / 'none.toml'} does not exist"
    writable = tmp_path / "writable.toml"
    writable.write_text('mode = "fp32"\n')
    os.chmod(writable, 0o666)
    refused = cli("run", str(path), "--config", str(writable), *flags, timeout=120)
    assert refused.returncode == 2
    assert "writable by" in _one_error_line(refused.stderr)
