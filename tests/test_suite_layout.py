"""The suite's layout. Test files sit in room folders that mirror the source (tests/core/,
tests/executor/models/, tests/frontend/openai/, zllm/'s rooms as tests/text/, tests/kv/, ...);
the helpers they share (servers, tiny_models, parity, ...) and conftest.py sit in tests/ itself.

- No module in tests/ imports a test module: tests share helpers through the modules in tests/,
  so a test file runs, moves or splits alone, and importing a helper runs no other file's
  fixtures.
- No two test files share a name: pytest imports each (its default "prepend" import mode, no
  __init__.py) as a top-level module named by its file, with its folder on sys.path.
- No folder of tests/ is named zllm: tests/ is on sys.path (the helpers are imported from it),
  and a folder there named zllm would be a namespace package that hides the editable install's
  zllm (its finder comes after the path's) wherever the repository itself is not on sys.path.
"""

from __future__ import annotations

import ast
from pathlib import Path

from python_source import parse_python

TESTS = Path(__file__).resolve().parent
TEST_FILES = sorted(TESTS.rglob("test_*.py"))
TEST_MODULES = {p.stem for p in TEST_FILES}


def imports_of_test_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, test module) of every import of a test module in `tree`, at module level or
    inside functions: `import test_x`, `from test_x import y`, `from tests import test_x`,
    `from . import test_x`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            modules = [base] + [f"{base}.{alias.name}".lstrip(".") for alias in node.names]
        else:
            continue
        for module in modules:
            parts = module.split(".")
            stem = parts[1] if parts[0] == "tests" and len(parts) > 1 else parts[0]
            if stem in TEST_MODULES and (node.lineno, stem) not in found:
                found.append((node.lineno, stem))
    return sorted(found)


def test_every_spelling_of_importing_a_test_module_is_found():
    source = (
        "import os\nfrom servers import start_server\n"
        "def f():\n    from test_lora import make_adapter\n"
        "import tests.test_model as m\nfrom . import test_sleep\nfrom tests import test_tools\n"
    )
    assert imports_of_test_modules(parse_python(source)) == [
        (4, "test_lora"), (5, "test_model"), (6, "test_sleep"), (7, "test_tools"),
    ]  # fmt: skip


def test_no_module_in_tests_imports_a_test_module():
    offenders = [
        f"{path.relative_to(TESTS)}:{line} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in imports_of_test_modules(parse_python(path.read_text(), str(path)))
    ]
    assert not offenders, "move what they share into a helper module:\n" + "\n".join(offenders)


def test_no_two_test_files_share_a_name():
    by_name: dict[str, list[str]] = {}
    for path in TEST_FILES:
        by_name.setdefault(path.name, []).append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not clashes, f"rename one of each (pytest imports them by file name): {clashes}"


def test_no_folder_of_tests_hides_the_zllm_package():
    hiding = [str(p.relative_to(TESTS)) for p in TESTS.rglob("zllm") if p.is_dir()]
    assert not hiding, f"name these folders for the room, not zllm: {hiding}"
