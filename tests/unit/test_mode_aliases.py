"""Lightning's precision strings and any case name our modes; an unknown mode is one line, exit 2,
with the closest names suggested."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from advisor.tune import TuneOptions
from policies import MODE_ALIASES, canonical_mode, mode_names
from probes import UsageError


@pytest.mark.parametrize(("given", "mode"), [
    ("16-mixed", "fp16-mixed"), ("bf16-mixed", "bf16-mixed"), ("bf16-true", "bf16-true"), ("32-true", "fp32"),
    ("32", "fp32"), ("16", "fp16-mixed"), ("bf16", "bf16-mixed"), ("16-true", "fp16-true"),
    ("BF16-Mixed", "bf16-mixed"), ("FP32", "fp32"), (" tf32 ", "tf32"), ("16-MIXED", "fp16-mixed"),
])
def test_lightning_names_and_any_case_mean_our_modes(given, mode):
    assert canonical_mode(given) == mode


def test_every_alias_names_a_registered_mode():
    assert set(MODE_ALIASES.values()) <= set(mode_names())
    assert all(canonical_mode(name) == name for name in mode_names())


def test_tune_options_keep_our_names():
    assert TuneOptions(modes=["16-mixed", "BF16-TRUE", "32"]).modes == ("fp16-mixed", "bf16-true", "fp32")


@pytest.mark.parametrize(("given", "suggested"), [("bf16-mixd", "bf16-mixed"), ("fp16mixed", "fp16-mixed"),
                                                  ("fp8-torchoa", "fp8-torchao")])
def test_an_unknown_mode_suggests_the_closest(given, suggested):
    with pytest.raises(UsageError) as caught:
        canonical_mode(given)
    message = str(caught.value)
    assert f"unknown mode {given!r}; did you mean {suggested}" in message and "\n" not in message
    assert caught.value.exit_code == 2


def test_nothing_close_suggests_nothing():
    with pytest.raises(UsageError, match=r"unknown mode 'xyzzy'; expected one of fp32, tf32"):
        canonical_mode("xyzzy")


def test_the_command_line_refuses_an_unknown_mode_in_one_line_with_exit_2(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    result = CliRunner().invoke(app, ["trial", str(script), "--mode", "bf16-mixd"])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "did you mean bf16-mixed" in lines[0], result.output


def test_mode_help_lists_the_choices():
    result = CliRunner().invoke(app, ["tune", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "fp8-torchao" in result.output and "16-mixed" in result.output
