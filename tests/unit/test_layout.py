"""The test tree's own rules: pytest imports test modules by basename (rootdir-relative, no
packages per folder), so two test files of one name in different folders stop the whole run at
collection; this says which, in seconds, instead."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_basename_of_its_own():
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
