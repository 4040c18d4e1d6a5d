"""The size rules of the layout (DESIGN.md, "Layout"; STYLE.md): no module of advisor, probes or
policies over 600 lines, no class over 150, and the three packages at 24,000 lines at most. A
module that passes 600 lines holds two jobs, and a class over 150 does; name them and split them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("advisor", "probes", "policies")
MODULE_LINES, CLASS_LINES, PRODUCT_LINES = 600, 150, 24_000


def _modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (ROOT / package).rglob("*.py"))


def long_classes(source: str) -> list[tuple[str, int]]:
    """``(name, lines)`` of each class in ``source`` over ``CLASS_LINES`` lines, nested ones too."""
    return [(node.name, node.end_lineno - node.lineno + 1) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > CLASS_LINES]


def test_the_class_rule_measures_a_class_from_its_line_to_its_end() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(CLASS_LINES))
    assert long_classes(f"class Small:\n{body[: body.rfind(chr(10))]}\n") == []
    assert long_classes(f"class Big:\n{body}\n") == [("Big", CLASS_LINES + 1)]


def test_no_module_over_600_lines() -> None:
    over = {path.relative_to(ROOT).as_posix(): n for path in _modules()
            if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert over == {}, "split each by the jobs it holds"


def test_no_class_over_150_lines() -> None:
    over = {f"{path.relative_to(ROOT).as_posix()}:{name}": n for path in _modules()
            for name, n in long_classes(path.read_text())}
    assert over == {}, "split each by its responsibilities, or move helpers out as functions"


def test_the_product_stays_within_24000_lines() -> None:
    total = sum(len(path.read_text().splitlines()) for path in _modules())
    assert total <= PRODUCT_LINES, f"{total} lines in {', '.join(PACKAGES)}: a change that grows it takes as much out"
