"""The README is a front page a newcomer reads to the end: at most 300 lines, a quick start of
exactly two commands that work on a fresh machine, and links that lead somewhere. Every relative
link in it and in the pages under docs/ names a file that exists, and an anchor, where it has
one, names a heading of that file."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _sections(text: str) -> dict[str, str]:
    """Each ``## `` section's body by its heading."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts), 2)}


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def _links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [target for target in LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def test_the_readme_is_at_most_300_lines():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 300


def test_the_quick_start_is_exactly_two_commands_that_create_the_environment():
    section = _sections(README.read_text(encoding="utf-8"))["Quick start"]
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section, flags=re.S | re.M)
    assert len(blocks) == 1
    commands = [line.split("#")[0].strip() for line in blocks[0].splitlines() if line.split("#")[0].strip()]
    assert commands == ["make demo", "make test"]
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    for target in ("demo", "test"):
        # each target builds .venv first, so it works on a fresh clone
        assert re.search(rf"^{target}:.*\bvenv\b", makefile, flags=re.M), target
    assert re.search(r"^venv:\n\t.*scripts/bootstrap\.sh", makefile, flags=re.M)


def test_the_plain_script_comes_first_among_the_ways_in():
    section = _sections(README.read_text(encoding="utf-8"))["Three ways in"]
    headings = re.findall(r"^### (.+)$", section, flags=re.M)
    assert headings[:3] == ["A plain PyTorch script", "A framework script: Lightning, Fabric, the HF Trainer, Accelerate",
                            "The Python API"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(page):
    assert _links(README)  # the pattern still finds the README's links
    broken = []
    for target in _links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no such heading")
    assert broken == []


def test_the_anchor_rule_matches_githubs_on_this_projects_headings():
    assert _anchor("Seeing a verdict: `mpadvise trial --plot`") == "seeing-a-verdict-mpadvise-trial---plot"
    assert _anchor("A framework script: Lightning, Fabric, the HF Trainer, Accelerate") == \
        "a-framework-script-lightning-fabric-the-hf-trainer-accelerate"
