"""``mpadvise env``: a paste-ready block with versions, hardware, the cache path and the
``MPADVISE_*`` settings, secrets masked; it works where there is no GPU or NVML."""

from __future__ import annotations

import io
import json
import sys
from importlib import metadata

import pytest
import typer
from rich.console import Console
from typer.testing import CliRunner

from advisor._version import __version__
from advisor.cli import _env
from advisor.cli._env import OPTIONAL_PACKAGES, env_report, mask_secret, render_env


@pytest.fixture
def app() -> typer.Typer:
    application = typer.Typer()

    @application.callback()
    def root() -> None:
        """mpadvise (test app)."""

    application.command("env")(_env.env)
    return application


@pytest.mark.parametrize(("name", "value", "shown"), [
    # Masked as every report masks a storage URL (shown_url): the password, "/" and "@" in it
    # included, and a password query parameter dropped; other secret-looking parameters masked.
    ("MPADVISE_STORAGE", "postgresql://tuner:s3cret@db.example:5432/studies",
     "postgresql://tuner:***@db.example:5432/studies"),
    ("MPADVISE_STORAGE", "postgresql://tuner:s3/cr@t@db.example:5432/studies",
     "postgresql://tuner:***@db.example:5432/studies"),
    ("MPADVISE_STORAGE", "postgresql://db.example/studies?user=t&password=s3cret&sslmode=require",
     "postgresql://db.example/studies?sslmode=require&user=t"),
    ("MPADVISE_STORAGE", "postgresql://db.example/studies?sslmode=require&token=abc",
     "postgresql://db.example/studies?sslmode=require&token=****"),
    ("MPADVISE_STORAGE", "sqlite:////home/u/.cache/mpadvise/studies.db", "sqlite:////home/u/.cache/mpadvise/studies.db"),
    ("MPADVISE_DAEMON_TOKEN", "abcdef0123456789", "****"),
    ("MPADVISE_API_KEY", "abc", "****"),
    ("MPADVISE_HOME", "/srv/mpadvise", "/srv/mpadvise"),
    ("MPADVISE_POLICY", "/w/train.mpadvise.toml", "/w/train.mpadvise.toml"),
])
def test_secrets_are_masked_and_the_rest_kept(name, value, shown):
    assert mask_secret(name, value) == shown


def test_the_report_names_versions_hardware_cache_and_settings(monkeypatch, tmp_path):
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path))
    environ = {"MPADVISE_HOME": str(tmp_path), "MPADVISE_STORAGE": "postgresql://u:hunter2@h/s", "HOME": "/root",
               "OTHER_TOKEN": "x"}
    report = env_report(environ)
    assert report["mpadvise"] == __version__
    assert report["python"].startswith(".".join(map(str, sys.version_info[:2])))
    import torch

    assert report["torch"]["version"] == torch.__version__
    assert set(report["packages"]) == set(OPTIONAL_PACKAGES)
    assert report["packages"]["optuna"] == metadata.version("optuna")
    assert report["cache"].startswith(str(tmp_path))
    assert report["environment"] == {"MPADVISE_HOME": str(tmp_path), "MPADVISE_STORAGE": "postgresql://u:***@h/s"}
    assert report["cpu"]["model"] and isinstance(report["cpu"]["flags"], list)
    assert isinstance(report["gpus"], list) and report["capability"]
    assert "hunter2" not in json.dumps(report)


def test_the_block_is_one_fact_per_line_even_at_80_columns():
    report = env_report({"MPADVISE_STORAGE": "postgresql://u:hunter2@a-very-long-host-name.example.org:5432/" + "s" * 60})
    report["packages"]["transformer-engine"] = None
    console = Console(record=True, width=80, file=io.StringIO())
    render_env(report, console)
    text = console.export_text()
    lines = text.splitlines()
    assert lines[0].startswith("Copy and paste")
    facts = [line for line in lines[2:] if line]
    assert all(line.startswith("- ") for line in facts), text  # no fact wrapped onto a second line
    for label in ("mpadvise", "Python", "torch", "transformer-engine", "torchao", "lightning", "transformers",
                  "accelerate", "optuna", "OS", "CPU", "capability", "cache", "environment"):
        assert any(line.startswith(f"- {label}: ") for line in facts), label
    assert "- transformer-engine: not installed" in facts
    assert "hunter2" not in text and "u:***@" in text


def test_the_command_prints_json_for_scripts(app, monkeypatch, tmp_path):
    monkeypatch.setenv("MPADVISE_HOME", str(tmp_path))
    monkeypatch.setenv("MPADVISE_STORAGE", "postgresql://u:hunter2@h/s")
    result = CliRunner().invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["environment"]["MPADVISE_STORAGE"] == "postgresql://u:***@h/s"
    assert "hunter2" not in result.stdout


def test_a_machine_without_nvml_reports_no_gpus_and_does_not_crash(monkeypatch):
    import probes

    def no_nvml() -> list:
        raise RuntimeError("NVML Shared Library Not Found")

    monkeypatch.setattr(probes, "cuda_profiles", no_nvml)  # the hardware boundary: no NVML here
    report = env_report({})
    assert report["gpus"] == []
    console = Console(record=True, width=80, file=io.StringIO())
    render_env(report, console)
    assert "- GPUs: none visible" in console.export_text()


@pytest.mark.parametrize("command", [["cache", "-h"], ["cache", "list", "-h"], ["cache", "show", "-h"],
                                     ["cache", "export", "-h"], ["cache", "import", "-h"], ["cache", "clear", "-h"]])
def test_the_cache_commands_take_dash_h(command):
    from advisor.cli import app

    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.output
