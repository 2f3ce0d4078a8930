"""The house rules on imports: a process folder imports only `zllm/` and itself, `zllm/`'s rooms
import no process folder and sit in layers, and only the executor imports torch. (The running
processes are checked in tests/test_server.py.)

`zllm/`'s rooms (each top-level module and each folder) are layers, bottom to top:

    errors -> sampling_params, pooling_params -> protocol -> model -> text -> kv, lora
           -> config -> media -> runtime -> proxy, bench -> inputs, outputs -> llm_pooling
           -> llm, async_llm, cli

A room imports only rooms below it: the wire (protocol) needs only what a request carries
(its SamplingParams; LoRARequest and DEFAULT_TENANT live in it); the model's files and shape
come before the text that tokenizes them, the KV and LoRA rules before the config that names
them, the config before the media rules it limits and the runtime that starts processes
from it, and the public face
(`LLM` with its pooling methods, `AsyncLLM`, the CLI) on top. An import inside a function counts like one at the top
of a module (as does one under TYPE_CHECKING): it is still a dependency, so hiding one there
does not break a cycle.

`executor/`'s rooms (each folder, and each module at its top) are layers too, bottom to top:

    kernels, host_to_device, step_timing -> parallel, kv, requests -> attention -> layers
           -> lora, weights -> models -> spec_decode, graphs -> host -> step_inputs
           -> sample, pooling -> launched_step -> model_runner -> async_steps -> ranks
           -> offline, main

The kernels, the tensor/pipeline-parallel primitives, the KV pool's blocks and a request's
state know no model; attention reads the pool's stored form; the layers (norms, matmuls, RoPE,
MoE, the attention module, the decoder skeleton) sit below every model and import none; the
weights' planning fills layers and serves the models; the model host puts models, weights,
KV cache and decode paths together; a step's inputs, its sampling, the runner and the
asynchronous executor come after it, the rank processes and the process entry points on top.
No model module imports another (models/__init__.py, the table of model classes, imports
them all); nothing in kernels/ or layers/ imports a model."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
from python_source import parse_python

ROOT = Path(__file__).resolve().parent.parent
PROCESS_FOLDERS = ("core", "executor", "frontend", "tokenizer_proc", "detokenizer_proc")
# zllm/: the public face and the wire at its top, the rest in rooms (folders).
TOP = {p.stem for p in (ROOT / "zllm").glob("*.py")} - {"__init__"}
ROOMS = {p.parent.name for p in (ROOT / "zllm").glob("*/__init__.py")}
SHARED = TOP | ROOMS


def imported_modules(path: Path) -> list[str]:
    tree = parse_python(path.read_text(), str(path))
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
    """What users import (vLLM's paths: `zllm.LLM`, `zllm.sampling_params`,
    `zllm.pooling_params`, `zllm.outputs`, `zllm.inputs`, `zllm.async_llm`, `zllm.lora`; `LLM`'s
    pooling methods beside it), the CLI, the errors and the wire (`zllm.protocol`); everything
    else lives in a room."""
    public = {"llm", "llm_pooling", "async_llm", "sampling_params", "pooling_params", "outputs",
              "inputs", "lora", "errors", "cli"}  # fmt: skip
    assert TOP == public | {"protocol"}
    assert ROOMS == {"config", "text", "kv", "model", "media", "bench", "runtime", "proxy"}


@pytest.mark.parametrize("room", ["config", "text", "kv", "model", "media", "runtime", "proxy"])
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


# Bottom to top (the module's docstring): a room imports only rooms in layers below its own.
LAYERS = (
    {"errors"},
    {"sampling_params", "pooling_params"},
    {"protocol"},
    {"model"},
    {"text"},
    {"kv", "lora"},
    {"config"},
    {"media"},
    {"runtime"},
    {"proxy", "bench"},
    {"inputs", "outputs"},
    {"llm_pooling"},
    {"llm", "async_llm", "cli"},
)


def _imported_names(node: ast.AST, package: list[str]) -> Iterator[str]:
    """The modules an import statement names, a relative one resolved against `package`;
    `from a import b` names `a` and `a.b` (b may be a module)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif isinstance(node, ast.ImportFrom):
        base = package[: len(package) - node.level + 1] if node.level else []
        module = ".".join([*base, *([node.module] if node.module else [])])
        yield module
        yield from (f"{module}.{alias.name}" for alias in node.names)


def room_imports(
    folder: Path = ROOT / "zllm", package: str = "zllm", rooms: set[str] = SHARED
) -> dict[str, dict[str, str]]:
    """room -> {a room it imports: where it first does (path:line)}, over every import in
    the room's files, inside functions included. A room is a top-level module or a folder of
    `folder`, which installs as `package`."""
    graph: dict[str, dict[str, str]] = {room: {} for room in rooms}
    prefix = package.split(".")
    depth = len(prefix)
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).parts
        if parts == ("__init__.py",):  # the package's face, no room
            continue
        room = parts[0] if len(parts) > 1 else path.stem
        for node in ast.walk(parse_python(path.read_text(), str(path))):
            for name in _imported_names(node, [*prefix, *parts[:-1]]):
                target = name.split(".")
                if target[:depth] == prefix and len(target) > depth and target[depth] in rooms:
                    if target[depth] != room:
                        where = f"{path.relative_to(ROOT)}:{node.lineno}"
                        graph[room].setdefault(target[depth], where)
    return graph


def find_cycle(graph: dict[str, dict[str, str]]) -> list[str] | None:
    """Some cycle of rooms (its first room repeated at its end), or None."""
    done: set[str] = set()
    path: list[str] = []

    def visit(room: str) -> list[str] | None:
        if room in path:
            return path[path.index(room) :] + [room]
        if room in done:
            return None
        path.append(room)
        for target in sorted(graph[room]):
            cycle = visit(target)
            if cycle is not None:
                return cycle
        path.pop()
        done.add(room)
        return None

    for room in sorted(graph):
        cycle = visit(room)
        if cycle is not None:
            return cycle
    return None


def test_find_cycle_finds_one_and_only_one():
    """The checker itself: a cycle through a function-level import is found, a chain is not."""
    chain = {"a": {"b": "a.py:1"}, "b": {"c": "b.py:1"}, "c": {}}
    assert find_cycle(chain) is None
    assert find_cycle({**chain, "c": {"a": "c.py:9"}}) == ["a", "b", "c", "a"]
    tree = parse_python("def f():\n    from . import engine\n    from zllm import kv\n")
    names = [n for node in ast.walk(tree) for n in _imported_names(node, ["zllm", "config"])]
    assert names == ["zllm.config", "zllm.config.engine", "zllm", "zllm.kv"]


def test_the_rooms_of_zllm_import_no_cycle():
    graph = room_imports()
    cycle = find_cycle(graph)
    if cycle is not None:
        steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
        pytest.fail("zllm/'s rooms import each other in a cycle:\n" + "\n".join(steps))


def test_a_room_of_zllm_imports_only_layers_below_it():
    """The order in the module's docstring, kept: a new room takes its place in LAYERS."""
    layer = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}
    assert set(layer) == SHARED, f"rooms without a layer: {sorted(SHARED - set(layer))}"
    bad = [
        f"{room} (layer {layer[room]}) imports {target} (layer {layer[target]}) at {where}"
        for room, targets in sorted(room_imports().items())
        for target, where in sorted(targets.items())
        if layer[target] >= layer[room]
    ]
    assert not bad, "\n".join(bad)


# ---- executor/'s rooms -------------------------------------------------------------------------
EXECUTOR = ROOT / "executor"
EXECUTOR_TOP = {p.stem for p in EXECUTOR.glob("*.py")} - {"__init__"}
EXECUTOR_ROOMS = {p.parent.name for p in EXECUTOR.glob("*/__init__.py")}
# Bottom to top (the module's docstring): a room imports only rooms in layers below its own.
EXECUTOR_LAYERS = (
    {"kernels", "host_to_device", "step_timing"},
    {"parallel", "kv", "requests"},
    {"attention"},
    {"layers"},
    {"lora", "weights"},
    {"models"},
    {"spec_decode", "graphs"},
    {"host"},
    {"step_inputs"},
    {"sample", "pooling"},
    {"launched_step"},
    {"model_runner"},
    {"async_steps"},
    {"ranks"},
    {"offline", "main"},
)


def executor_room_imports() -> dict[str, dict[str, str]]:
    return room_imports(EXECUTOR, "zllm.executor", EXECUTOR_TOP | EXECUTOR_ROOMS)


def test_the_rooms_of_the_executor_import_no_cycle():
    graph = executor_room_imports()
    cycle = find_cycle(graph)
    if cycle is not None:
        steps = [f"{a} -> {b} ({graph[a][b]})" for a, b in zip(cycle, cycle[1:], strict=False)]
        pytest.fail("executor/'s rooms import each other in a cycle:\n" + "\n".join(steps))


def test_a_room_of_the_executor_imports_only_layers_below_it():
    """The order in the module's docstring, kept: a new room takes its place in
    EXECUTOR_LAYERS (a module at executor/'s top is a room of its own)."""
    layer = {room: i for i, rooms in enumerate(EXECUTOR_LAYERS) for room in rooms}
    rooms = EXECUTOR_TOP | EXECUTOR_ROOMS
    assert set(layer) == rooms, f"rooms without a layer: {sorted(rooms - set(layer))}"
    bad = [
        f"{room} (layer {layer[room]}) imports {target} (layer {layer[target]}) at {where}"
        for room, targets in sorted(executor_room_imports().items())
        for target, where in sorted(targets.items())
        if layer[target] >= layer[room]
    ]
    assert not bad, "\n".join(bad)


def _imports_of(path: Path) -> Iterator[tuple[int, list[str]]]:
    """(line, the module path as parts) of every import in `path`, functions' included."""
    package = ["zllm", *path.parent.relative_to(ROOT).parts]
    for node in ast.walk(parse_python(path.read_text(), str(path))):
        for name in _imported_names(node, package):
            yield node.lineno, name.split(".")


def test_no_model_module_imports_another():
    """A model is one module of executor/models/ (llama.py, gemma3.py, ...) or one folder of
    them (transformers/, vision/); what models share lives in layers/. Only models/__init__.py,
    the table of model classes, imports them all (and no model imports that table)."""
    models = EXECUTOR / "models"
    bad = []
    for path in sorted(models.rglob("*.py")):
        if path == models / "__init__.py":
            continue
        own = path.relative_to(models).parts[0].removesuffix(".py")
        for line, target in _imports_of(path):
            if target[:3] != ["zllm", "executor", "models"]:
                continue
            if len(target) == 3 or target[3] != own:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {'.'.join(target)}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("room", ["kernels", "layers"])
def test_kernels_and_layers_import_no_model(room):
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {'.'.join(target)}"
        for path in sorted((EXECUTOR / room).rglob("*.py"))
        for line, target in _imports_of(path)
        if target[:3] == ["zllm", "executor", "models"]
    ]
    assert not bad, "\n".join(bad)
