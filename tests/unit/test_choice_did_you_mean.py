"""``--framework`` and ``export --to`` list their choices in ``--help``, take any case, and answer
an unknown value in one line, exit 2, with the closest choices suggested (as ``--mode`` does)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from advisor.cli import app
from advisor.frameworks import FRAMEWORKS, check_framework, check_target, export_targets
from probes import UsageError


@pytest.mark.parametrize(("given", "name"), [("Lightning", "lightning"), ("FABRIC", "fabric"),
                                             (" transformers ", "transformers")])
def test_a_framework_in_any_case(given, name):
    assert check_framework(given) == name


@pytest.mark.parametrize(("given", "name"), [("DeepSpeed", "deepspeed"), ("TorchTitan", "torchtitan"),
                                             ("Accelerate", "accelerate")])
def test_an_export_target_in_any_case(given, name):
    assert check_target(given) == name


@pytest.mark.parametrize(("check", "given", "suggested", "what"), [
    (check_framework, "lightnin", "lightning", "framework"),
    (check_framework, "transformer", "transformers", "framework"),
    (check_target, "deepspeeed", "deepspeed", "export target"),
    (check_target, "torchtitn", "torchtitan", "export target"),
])
def test_an_unknown_choice_suggests_the_closest(check, given, suggested, what):
    with pytest.raises(UsageError) as caught:
        check(given)
    message = str(caught.value)
    assert message.startswith(f"unknown {what} {given!r}; did you mean {suggested}") and "\n" not in message
    assert caught.value.exit_code == 2


def test_nothing_close_suggests_nothing_and_lists_all():
    with pytest.raises(UsageError) as caught:
        check_framework("keras")
    assert str(caught.value) == f"unknown framework 'keras'; expected one of {', '.join(FRAMEWORKS)}"


def _lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.strip()]


@pytest.mark.parametrize("command", ["tune", "trial", "run"])
def test_the_command_line_suggests_a_framework_in_one_line_with_exit_2(tmp_path, command):
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    result = CliRunner().invoke(app, [command, str(script), "--framework", "lightnig"])
    assert result.exit_code == 2, result.output
    lines = _lines(result.output)
    assert len(lines) == 1 and "did you mean lightning?" in lines[0], result.output


def test_export_suggests_a_target_in_one_line_with_exit_2(tmp_path):
    config = tmp_path / "a.mpadvise.toml"
    config.write_text('mode = "fp32"\n')
    config.chmod(0o600)
    result = CliRunner().invoke(app, ["export", str(config), "--to", "lightnign"])
    assert result.exit_code == 2, result.output
    lines = _lines(result.output)
    assert len(lines) == 1 and "did you mean lightning?" in lines[0], result.output


def test_export_takes_a_target_in_any_case(tmp_path):
    config = tmp_path / "a.mpadvise.toml"
    config.write_text('mode = "fp32"\n')
    config.chmod(0o600)
    result = CliRunner().invoke(app, ["export", str(config), "--to", "Lightning"])
    assert result.exit_code == 0, result.output
    assert "precision" in result.output


@pytest.mark.parametrize(("argv", "choices"), [
    (["tune", "--help"], FRAMEWORKS), (["trial", "--help"], FRAMEWORKS), (["run", "--help"], FRAMEWORKS),
    (["export", "--help"], export_targets()),
])
def test_help_lists_the_choices(argv, choices):
    result = CliRunner().invoke(app, argv, env={"COLUMNS": "300"})
    assert result.exit_code == 0
    text = " ".join(result.output.split())
    assert all(choice in text for choice in choices), result.output
