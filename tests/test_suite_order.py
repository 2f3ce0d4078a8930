"""The suite's files go out to the workers longest first (tests/suite_order.py)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import suite_order


def test_files_go_longest_first_unknown_ones_before_them_and_tests_keep_their_order(
    monkeypatch,
) -> None:
    seconds = {"tests/a.py": 5.0, "tests/b.py": 50.0, "tests/c.py": 20.0}
    monkeypatch.setattr(suite_order, "recorded_seconds", lambda: seconds)
    ids = ["tests/a.py::x", "tests/b.py::y", "tests/new.py::z", "tests/a.py::w",
           "tests/c.py::v", "tests/b.py::u"]  # fmt: skip
    items = [SimpleNamespace(nodeid=i) for i in ids]
    suite_order.longest_files_first(items)
    assert [i.nodeid for i in items] == [
        "tests/new.py::z", "tests/b.py::y", "tests/b.py::u", "tests/c.py::v",
        "tests/a.py::x", "tests/a.py::w",
    ]  # fmt: skip


def test_the_record_names_files_that_exist() -> None:
    root = Path(__file__).parent.parent
    recorded = suite_order.recorded_seconds()
    assert len(recorded) > 100
    missing = [name for name in recorded if not (root / name).is_file()]
    assert not missing, f"tests/file_seconds.json names files that are gone: {missing}"
