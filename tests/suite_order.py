"""Longest files first: the order pytest-xdist hands the suite's files to its two workers.

With `--dist loadfile` a file runs whole on one worker, and a worker takes the next file
when it is free, so a long file handed out last keeps one core busy while the other idles.
Ordering the files by the seconds each took in a recent run (tests/file_seconds.json,
written by `ZLLM_TEST_TIMES=tests/file_seconds.json pytest`, a fresh clone's run) gives the
longest-first schedule whose tail is the shortest files; a file not in the record (a new
one) goes first, its time unknown. pyproject's addopts turn xdist's own reordering (by the
number of tests in a file) off so that this order holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")


def recorded_seconds() -> dict[str, float]:
    try:
        return json.loads(SECONDS_FILE.read_text())
    except (OSError, ValueError):
        return {}


def longest_files_first(items: list[pytest.Item]) -> None:
    """Sort `items` in place: files by recorded seconds, longest (or unknown) first; each
    file's tests keep their order."""
    seconds = recorded_seconds()
    unknown = max(seconds.values(), default=0.0) + 1.0
    first_index: dict[str, int] = {}
    for index, item in enumerate(items):
        first_index.setdefault(item.nodeid.split("::", 1)[0], index)

    def key(item: pytest.Item) -> tuple[float, int]:
        test_file = item.nodeid.split("::", 1)[0]
        return (-seconds.get(test_file, unknown), first_index[test_file])

    items.sort(key=key)
