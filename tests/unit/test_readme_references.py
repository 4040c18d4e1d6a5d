"""What the README and the pages under docs/ name must exist: every repository path they cite (a
script, an example, a test, a record), every option they give an ``mpadvise`` command, and every
option they give a script under scripts/. A figure whose command has gone is a claim nothing
backs any more. Raw bench output is not kept in the repository (docs/bench/ is ignored), so no
page may point into it: a figure names the script that reproduces it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from advisor.cli import app

ROOT = Path(__file__).resolve().parents[2]
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text(encoding="utf-8")
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]}
TEXT = "\n".join(PAGES.values())

# Options the documentation describes ahead of the code that is landing them; each must still be
# missing, so that the entry is removed (and the option checked like any other) once it lands.

PATH = re.compile(r"(?<![\w/.-])((?:docs|scripts|examples|tests|advisor|probes|policies)/[\w./-]*\w\.(?:py|sh|json|md|toml|yaml|txt))")
FLAG = re.compile(r"^\[?(--?[a-zA-Z][\w-]*)")


def _spans(readme: str) -> list[str]:
    """Every command-like text: inline code spans, and shell lines of code blocks (``$ ...``,
    continuation lines joined)."""
    spans = re.findall(r"`([^`\n]+)`", readme)
    lines = readme.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i].strip()
        if line.startswith("$ "):
            text = line[2:]
            while text.endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text[:-1] + " " + lines[i].strip()
            spans.append(text)
        i += 1
    return spans


SPANS = [span for text in PAGES.values() for span in _spans(text)]  # once, for every check below


def _invocations(word: str) -> list[list[str]]:
    """The tokens after each ``word`` that starts a command in a span, up to a lone ``--`` (the
    script's own arguments) or a shell pipe or redirection."""
    found = []
    for span in SPANS:
        tokens = span.split()
        for at, token in enumerate(tokens):
            if token == word or token.endswith("/" + word):
                rest = []
                for t in tokens[at + 1:]:
                    if t in ("--", "|", ">", "&&", ";"):
                        break
                    rest.append(t)
                found.append(rest)
    return found


def _options(command) -> set[str]:
    return {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)} | {"-h", "--help"}


def _flags(tokens: list[str]) -> list[str]:
    return [m.group(1) for t in tokens if (m := FLAG.match(t))]


def test_every_path_the_documentation_names_exists():
    named = sorted(set(PATH.findall(TEXT)))
    assert len(named) > 50  # the pattern still finds the pages' scripts, examples and tests
    assert [p for p in named if not (ROOT / p).exists()] == []


def test_no_page_points_into_the_ignored_bench_output():
    assert [name for name, text in PAGES.items() if "docs/bench/" in text] == []


def test_every_option_an_mpadvise_command_is_given_in_the_documentation_exists():
    root = typer.main.get_command(app)
    checked, unknown = 0, []
    for tokens in _invocations("mpadvise"):
        command, group, at = root, None, 0
        while hasattr(command, "commands") and at < len(tokens):  # a group (typer ships its own click)
            name = tokens[at].split("\\|")[0]
            if name not in command.commands:
                break
            group, command = command, command.commands[name]
            at += 1
        # A synopsis of alternatives ("list\|show ID\|export FILE"): each one's options count.
        alternatives = [group.commands[n] for t in tokens[at - 1:] for n in t.split("\\|")[1:]
                        if n in group.commands] if group is not None else []
        allowed = _options(command).union(*(_options(c) for c in alternatives))
        rest = tokens[at:]
        for flag in _flags(rest):
            checked += 1
            if flag not in allowed:
                unknown.append(f"mpadvise {' '.join(tokens)}: {flag}")
    assert checked > 30
    assert unknown == []


@pytest.mark.parametrize("script", sorted(p.name for p in (ROOT / "scripts").iterdir() if p.suffix in (".py", ".sh")))
def test_every_option_a_script_is_given_in_the_documentation_exists(script):
    source = (ROOT / "scripts" / script).read_text(encoding="utf-8")
    unknown = [flag for tokens in _invocations(f"scripts/{script}") for flag in _flags(tokens)
               if not re.search(re.escape(flag) + r"(?![\w-])", source)]
    assert unknown == []
