"""What a user meets first: a Ctrl-C while typer parses or prints help is one line and exit
130, and ``advisor.tune`` stays the public function however the subpackage of that name is
imported."""

from __future__ import annotations

import sys

import pytest
from typer.core import TyperGroup
from typer.testing import CliRunner

import advisor
from advisor.cli._app import app

runner = CliRunner()

def test_ctrl_c_while_typer_parses_is_one_line_and_exit_130(monkeypatch):
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(TyperGroup, "make_context", interrupted)
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 130
    assert result.output.strip().splitlines() == ["error: interrupted"]


def test_advisor_tune_stays_the_function_when_its_subpackage_is_imported(monkeypatch):
    tune = advisor.tune
    assert callable(tune) and tune.__module__ == "advisor.tune._api"
    # What the import system does when ``advisor.tune`` (or a module under it) is first imported:
    # it sets the package's attribute to the subpackage.
    monkeypatch.setattr(advisor, "tune", sys.modules["advisor.tune"])
    assert advisor.tune is tune
    other = object()
    monkeypatch.setattr(advisor, "tune", other)  # anything else is set as given
    assert advisor.tune is other


@pytest.mark.parametrize("name", sorted(set(advisor.__all__) - {"__version__"}))
def test_every_public_name_loads_on_first_use(name):
    assert getattr(advisor, name) is not None and name in dir(advisor)
