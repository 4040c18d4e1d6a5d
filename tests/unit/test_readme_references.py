"""What the README names must exist: every repository path it cites (a benchmark's record, a
script, an example, a test), every option it gives an ``mpadvise`` command, and every option it
gives a script under scripts/. A figure whose record or command has gone is a claim nothing
backs any more."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer

from advisor.cli import app

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")

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


SPANS = _spans(README)  # once, for every command and script checked below


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


def test_every_path_the_readme_names_exists():
    named = sorted(set(PATH.findall(README)))
    assert len(named) > 50  # the pattern still finds the README's records and scripts
    assert [p for p in named if not (ROOT / p).exists()] == []


def test_every_option_an_mpadvise_command_is_given_in_the_readme_exists():
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
def test_every_option_a_script_is_given_in_the_readme_exists(script):
    source = (ROOT / "scripts" / script).read_text(encoding="utf-8")
    unknown = [flag for tokens in _invocations(f"scripts/{script}") for flag in _flags(tokens)
               if not re.search(re.escape(flag) + r"(?![\w-])", source)]
    assert unknown == []
