"""The test tree collects: pytest imports each test file by its base name (the tiers have no
`__init__.py`), so two files of one name in different tiers stop the whole run at collection."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_every_test_file_name_is_unique_across_the_tiers() -> None:
    names = Counter(p.name for p in TESTS.rglob("test_*.py") if "fixtures" not in p.parts)
    assert not [n for n, k in names.items() if k > 1], sorted(n for n, k in names.items() if k > 1)
