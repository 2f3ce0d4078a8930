"""No module in tests/ imports a test module: tests share helpers through the modules beside
them (servers, tiny_models, parity, paged_reference, chat_prompts, solo, csrc_emulator,
shared_gguf_reader, gguf_files, resident_memory, lora_adapters, disagg_pairs, served_answers,
offline_answers, kv_tiers, scheduler_parts, tool_calls, model_cases, paged_runner), so a test
file runs, moves or splits alone, and importing a helper runs no other file's fixtures."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
TEST_MODULES = {p.stem for p in TESTS.glob("test_*.py")}


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
    assert imports_of_test_modules(ast.parse(source)) == [
        (4, "test_lora"), (5, "test_model"), (6, "test_sleep"), (7, "test_tools"),
    ]  # fmt: skip


def test_no_module_in_tests_imports_a_test_module():
    offenders = [
        f"{path.name}:{line} imports {module}"
        for path in sorted(TESTS.glob("*.py"))
        for line, module in imports_of_test_modules(ast.parse(path.read_text(), str(path)))
    ]
    assert not offenders, "move what they share into a helper module:\n" + "\n".join(offenders)
