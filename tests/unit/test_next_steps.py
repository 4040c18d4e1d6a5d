"""The next steps a tune's report prints work when pasted where it is read: the script's path as
seen from there, its arguments after ``--`` and shell-quoted, and no line to add that the script
already has."""

from __future__ import annotations

import functools
import io
import shlex

import pytest
import typer
from rich.console import Console

from advisor.cli._app import app
from advisor.cli._report import render_tune
from advisor.tune._service import calls_load_policy

# The whole report (mpadvise tune --verbose): it holds every figure these tests read.
render_verbose = functools.partial(render_tune, verbose=True)

ARGS = ["--epochs", "1", "--data", "./my data", "--name=it's"]


def _report(tune: dict) -> list[str]:
    console = Console(record=True, width=400, file=io.StringIO())
    render_verbose(tune, console)
    return console.export_text().splitlines()


def _tune(script, **extra) -> dict:
    return {"winner": {"schema": 1, "mode": "bf16-mixed"}, "winner_label": "bf16-mixed", "speedup_vs_fp32": 1.2,
            "speedup": {"ratio": 1.2, "basis": "paired re-measurement, 2 pairs", "pairs": 2}, "candidates": [],
            "script": str(script), "args": list(ARGS), "config_file": str(script.with_name("x.mpadvise.toml")),
            **extra}


def _parsed(line: str, verb: str) -> dict:
    """The parameters ``mpadvise`` parses from a pasted command line, without running it."""
    argv = shlex.split(line)
    assert argv[:2] == ["mpadvise", verb], argv
    group = typer.main.get_command(app)
    parent = group.make_context("mpadvise", [verb], resilient_parsing=True)
    command = group.get_command(parent, verb)
    return command.make_context(verb, argv[2:], parent=parent).params


def _pasted(lines: list[str], prefix: str, start: str) -> str:
    """The command in the line that starts with ``prefix``, from ``start`` up to `` (`` or the end."""
    line = next(ln for ln in lines if ln.startswith(prefix))
    command = line[line.index(start):]
    return command.split(" (or ")[0]


@pytest.fixture
def in_project(tmp_path, monkeypatch):
    """A project directory holding ``examples/lightning_mlp.py``; the report is read there."""
    script = tmp_path / "examples" / "lightning_mlp.py"
    script.parent.mkdir()
    script.write_text("import lightning\n")
    monkeypatch.chdir(tmp_path)
    return script


def test_the_run_line_names_the_script_from_here_with_its_arguments(in_project):
    lines = _report(_tune(in_project, framework="lightning"))
    command = _pasted(lines, "train with it: ", "mpadvise run ")
    params = _parsed(command, "run")
    assert str(params["script"]) == "examples/lightning_mlp.py" and params["script"].is_file()
    assert params["script_args"] == ARGS
    export = next(ln for ln in lines if ln.startswith("train with it: ")).split("(or ", 1)[1].rstrip(")")
    params = _parsed(export, "export")
    assert str(params["config"]) == "examples/x.mpadvise.toml" and params["to"] == "lightning"


def test_the_resume_line_continues_the_same_study(in_project, cache_home):
    storage = f"sqlite:///{in_project.parent / 'studies.db'}"
    lines = _report(_tune(in_project, storage=storage, study_name="s"))
    command = _pasted(lines, "study ", "mpadvise tune ").rstrip(")")
    params = _parsed(command, "tune")
    assert str(params["script"]) == "examples/lightning_mlp.py" and params["script_args"] == ARGS
    assert params["resume"] and params["storage"] == storage


def test_a_multi_process_tune_is_continued_with_its_own_command_line(in_project, cache_home):
    """The command line's tune hands the report the command as typed: --nproc-per-node names
    the study, and the JSON alone does not hold it."""
    from advisor.cli._tune import resume_command
    from advisor.tune import TuneOptions

    typed = resume_command(in_project.relative_to(in_project.parents[1]), ARGS, TuneOptions(nproc_per_node=2))
    lines = _report(_tune(in_project, storage="sqlite:///x.db", study_name="s", resume_command=typed))
    command = _pasted(lines, "study ", "continue with: ")[len("continue with: "):].rstrip(")")
    assert command == typed
    argv = shlex.split(command)  # the program as it was started (mpadvise, python -m advisor.cli...)
    params = _parsed(shlex.join(["mpadvise", *argv[argv.index("tune"):]]), "tune")
    assert params["resume"] and params["nproc_per_node"] == 2 and params["script_args"] == ARGS


def test_a_script_outside_the_working_directory_keeps_its_full_path(tmp_path, monkeypatch):
    script = tmp_path / "elsewhere" / "train.py"
    script.parent.mkdir()
    script.write_text("import lightning\n")
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    params = _parsed(_pasted(_report(_tune(script, framework="lightning")), "train with it: ", "mpadvise run "), "run")
    assert params["script"] == script and params["script_args"] == ARGS


@pytest.mark.parametrize("source", [
    "import advisor\nmp = advisor.load_policy()\n",
    "from advisor import load_policy\nmp = load_policy()\n",
    "import advisor as a\nmp = a.load_policy()\n",
    "import advisor\nwith advisor.load_policy() as mp:\n    pass\n",
    "from advisor import load_policy as lp\nmp = lp()\n",
    "def main():\n    from advisor import load_policy\n    return load_policy()\n",
])
def test_a_script_that_calls_load_policy_is_not_told_to_add_it(tmp_path, source):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert calls_load_policy(script)
    lines = _report(_tune(script, calls_load_policy=calls_load_policy(script)))
    assert not any("add to the script" in ln for ln in lines)
    assert any("the script calls advisor.load_policy()" in ln for ln in lines)


@pytest.mark.parametrize("source", [
    "# advisor.load_policy() is not called here\nprint('train')\n",
    "def load_policy():\n    return None\nload_policy()\n",  # its own function of that name
    "import other\nother.load_policy()\n",
])
def test_a_script_that_never_calls_advisors_load_policy_is_not_taken_for_one(tmp_path, source):
    script = tmp_path / "train.py"
    script.write_text(source)
    assert not calls_load_policy(script)


def test_a_script_without_load_policy_is_told_to_add_it(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("# advisor.load_policy() is not called here\nprint('train')\n")
    lines = _report(_tune(script, calls_load_policy=calls_load_policy(script)))
    assert any("add to the script: mp = advisor.load_policy()" in ln for ln in lines)
