"""What a user meets first: ``mpadvise --help`` groups the commands by what they are for, a
Ctrl-C while typer parses or prints help is one line and exit 130, and ``advisor.tune`` stays
the public function however the subpackage of that name is imported."""

from __future__ import annotations

import re
import sys

import pytest
from typer.core import TyperGroup
from typer.main import get_command
from typer.testing import CliRunner

import advisor
from advisor.cli._app import app

runner = CliRunner()

PANELS = {
    "Tune": {"tune", "trial"},
    "Apply": {"run", "policy", "show", "export"},
    "Cache": {"cache", "study"},
    "Service": {"daemon"},
    "Machine": {"probe", "env"},
}


def _panels(help_text: str) -> dict[str, set[str]]:
    """Each boxed panel of a rich help page: its title, and the first word of each row."""
    panels: dict[str, set[str]] = {}
    current: set[str] | None = None
    for line in help_text.splitlines():
        title = re.match(r"\s*╭─ (.+?) ─", line)
        if title:
            current = panels.setdefault(title.group(1), set())
        elif line.lstrip().startswith("╰"):
            current = None
        elif current is not None:
            row = re.match(r"\s*│ (\S+)", line)
            if row and not row.group(1).startswith("-"):
                current.add(row.group(1))
    return panels


def test_help_groups_every_command_into_its_panel():
    result = runner.invoke(app, ["--help"], env={"COLUMNS": "120"})
    assert result.exit_code == 0, result.output
    panels = _panels(result.output)
    assert {name: panels.get(name) for name in PANELS} == PANELS, result.output
    assert "Commands" not in panels, "a command without a panel: give it rich_help_panel="


def test_every_command_names_its_panel():
    """A command added later says where it belongs too."""
    commands = get_command(app).commands
    assert set(commands) == set().union(*PANELS.values())
    for name, command in commands.items():
        assert name in PANELS.get(command.rich_help_panel, ()), (name, command.rich_help_panel)


def test_ctrl_c_while_typer_parses_is_one_line_and_exit_130(monkeypatch):
    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(TyperGroup, "make_context", interrupted)
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 130
    assert result.output.strip().splitlines() == ["error: interrupted"]


def test_advisor_tune_stays_the_function_when_its_subpackage_is_imported(monkeypatch):
    tune = advisor.tune
    assert callable(tune) and tune.__module__ == "advisor.tune._service"
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
