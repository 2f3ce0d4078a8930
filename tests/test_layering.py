"""The house rules on imports: a process folder imports only `zllm/` and itself, `zllm/`'s rooms
import no process folder, and only the executor imports torch. (The running processes are
checked in tests/test_server.py.)"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PROCESS_FOLDERS = ("core", "executor", "frontend", "tokenizer_proc", "detokenizer_proc")
# zllm/: the public face and the wire at its top, the rest in rooms (folders).
TOP = {p.stem for p in (ROOT / "zllm").glob("*.py")} - {"__init__"}
ROOMS = {p.parent.name for p in (ROOT / "zllm").glob("*/__init__.py")}
SHARED = TOP | ROOMS


def imported_modules(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("folder", PROCESS_FOLDERS)
def test_a_process_folder_imports_only_zllm_and_itself(folder):
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] != "zllm" or len(parts) == 1:
                continue
            if parts[1] != folder and parts[1] not in SHARED:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "folder", ["zllm", "core", "frontend", "tokenizer_proc", "detokenizer_proc"]
)
def test_only_the_executor_imports_torch(folder):
    # Inside functions, on purpose: zllm/llm.py builds the executor's ModelRunner (the offline
    # engine), zllm/bench/cli.py runs transformers (the peer `zllm bench` measures against).
    allowed = {"zllm/llm.py", "zllm/bench/cli.py"}
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        names = imported_modules(path)
        if rel not in allowed and any(n == "torch" or n.startswith("torch.") for n in names):
            bad.append(f"{rel} imports torch")
        if rel not in allowed and any(n.startswith("zllm.executor") for n in names):
            bad.append(f"{rel} imports the executor")
    assert not bad, "\n".join(bad)


def test_the_top_of_zllm_is_the_public_face_and_the_wire():
    """What users import (vLLM's paths: `zllm.LLM`, `zllm.sampling_params`, `zllm.outputs`,
    `zllm.inputs`, `zllm.async_llm`, `zllm.lora`), the CLI, the errors and the wire
    (`zllm.protocol`); everything else lives in a room."""
    public = {"llm", "async_llm", "sampling_params", "outputs", "inputs", "lora", "errors", "cli"}
    assert TOP == public | {"protocol"}
    assert ROOMS == {"config", "text", "kv", "model", "bench", "runtime", "proxy"}


@pytest.mark.parametrize("room", ["config", "text", "kv", "model", "runtime", "proxy"])
def test_a_room_of_zllm_imports_no_process_folder(room):
    """The rooms are what the processes share: none reaches into a process's folder (the
    offline `LLM` and `zllm bench` do, on purpose: they run the engine in one process; `zllm
    proxy` answers its own errors in the servers' body shape, frontend/replies.py)."""
    allowed = {("proxy", "zllm.frontend.replies")}
    bad = []
    for path in sorted((ROOT / "zllm" / room).rglob("*.py")):
        for name in imported_modules(path):
            parts = name.split(".")
            if (room, name) in allowed or parts[0] != "zllm" or len(parts) == 1:
                continue
            if parts[1] in PROCESS_FOLDERS:
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, "\n".join(bad)
