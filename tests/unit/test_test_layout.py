"""The test tree's one rule that pytest enforces only at collection: module basenames are unique.

tests/unit, tests/integration and tests/gpu have no __init__.py, so pytest imports each test
module by its file name; two files of one name stop the whole collection.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
