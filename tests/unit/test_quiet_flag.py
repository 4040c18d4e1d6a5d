"""``--quiet``/``-q`` is declared on ``tune`` and ``trial`` with its help, and ``tune`` takes
``--dry-run``: both reach the command's help."""

from __future__ import annotations

import typer

from advisor.cli._app import app


def _params(name: str) -> dict:
    return {p.name: p for p in typer.main.get_command(app).commands[name].params}


def test_tune_and_trial_declare_quiet_with_its_help():
    for name in ("tune", "trial"):
        quiet = _params(name)["quiet"]
        assert quiet.opts == ["--quiet", "-q"] and quiet.default is False
        assert "only the result" in quiet.help and "errors still go to stderr" in quiet.help


def test_tune_declares_dry_run():
    dry_run = _params("tune")["dry_run"]
    assert dry_run.opts == ["--dry-run"] and "nothing is written" in dry_run.help
    assert "dry_run" not in _params("trial")
