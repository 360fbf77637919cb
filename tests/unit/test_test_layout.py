"""The test tree's own layout: pytest imports test modules by basename (rootdir mode, no packages),
so two ``test_x.py`` in different folders stop collection on a clean checkout. Keep them unique."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_test_module_basenames_are_unique() -> None:
    names = Counter(path.name for path in TESTS.rglob("test_*.py"))
    repeated = sorted(name for name, count in names.items() if count > 1)
    assert not repeated, f"test modules sharing a basename (rename one of each): {repeated}"
