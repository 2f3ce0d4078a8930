"""The tree's shape, as issue 55 set it: a folder's top holds a dozen modules and the rest sit
in rooms named for their job; no module grows past 600 lines, no function past 60 in the
process folders, so a newcomer finds a rule in one guess and reads it on one screen."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from python_source import parse_python

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("zllm", "core", "executor", "frontend", "tokenizer_proc", "detokenizer_proc")
# Every Python file outside tests/ is held to the size limit, the benchmarks' scripts too.
NON_TEST_FOLDERS = (*SOURCE_FOLDERS, "benchmarks")
MAX_TOP_MODULES = 12
MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 60
# The one wire module holds every message type by design (the house rules).
LONG_BY_DESIGN = {"zllm/protocol.py"}


def sources(folders: tuple[str, ...]) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", ["core", "executor", "frontend"])
def test_a_process_folder_keeps_a_dozen_modules_at_its_top(folder):
    top = sorted(p.name for p in (ROOT / folder).glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, f"{folder}/ has {len(top)} modules at its top: {top}"


def test_no_module_is_longer_than_a_long_read():
    long = []
    for path in sources(NON_TEST_FOLDERS):
        rel = str(path.relative_to(ROOT))
        lines = path.read_text().count("\n")
        if lines > MAX_FILE_LINES and rel not in LONG_BY_DESIGN:
            long.append(f"{rel}: {lines} lines")
    assert not long, "\n".join(long)


def test_no_function_in_a_process_folder_is_longer_than_a_screen():
    long = []
    for path in sources(("core", "executor", "frontend")):
        for node in ast.walk(parse_python(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    long.append(f"{where} {node.name}: {length} lines")
    assert not long, "\n".join(long)
