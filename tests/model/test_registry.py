"""The model families' registry (zllm/model/registry.py): one row per family, every name a
model's files may give claimed by one family, no architecture named anywhere else in the
product's code, and reading a model into its record one pass through registry -> family ->
back (no module entered twice)."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter
from python_source import parse_python
from tiny_models import write_tiny_model

from zllm.model import registry
from zllm.model.arch import arch_of
from zllm.model.families import transformers as transformers_family
from zllm.model.family import Feature
from zllm.model.gguf import read_gguf

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("zllm", "core", "executor", "frontend", "tokenizer_proc", "detokenizer_proc")
# Where architectures may be named: each family's own module and the registry.
HOMES = ("zllm/model/families/", "zllm/model/registry.py")
# Strings that spell an architecture's name but name something else, each with what it is.
OTHER_NAMESPACES = {
    ("zllm/model/files.py", "gemma3"): "the short name of a downloadable model",
    ("zllm/config/serve.py", "mistral"): "a --tool-call-parser name",
    ("zllm/config/serve.py", "qwen3"): "a --reasoning-parser name",
    ("zllm/text/tool_parsers/__init__.py", "mistral"): "a tool parser's registry name",
    ("zllm/text/reasoning_parser.py", "qwen3"): "a reasoning parser's registry name",
    ("frontend/tools.py", "mistral"): "the mistral tool parser's call tag",
    **{
        (module, name): what
        for name in ("deepseek_v3", "kimi_k2", "minimax_m2")
        for module, what in (
            ("zllm/config/serve.py", "a --tool-call-parser name"),
            ("zllm/text/tool_parsers/__init__.py", "a tool parser's registry name"),
            ("frontend/tools.py", "a tool parser whose call tags are special tokens"),
        )
    },
    ("zllm/text/reasoning_parser.py", "kimi_k2"): "a reasoning parser's registry name",
    ("zllm/text/reasoning_parser.py", "minimax_m2"): "a reasoning parser's registry name",
    ("zllm/text/tokenizer.py", "llama"): "a GGUF tokenizer model (tokenizer.ggml.model)",
    ("zllm/text/gguf_pre_tokenizers.py", "qwen2"): "a GGUF pre-tokenizer (tokenizer.ggml.pre)",
    ("zllm/text/gguf_pre_tokenizers.py", "qwen35"): "a GGUF pre-tokenizer (tokenizer.ggml.pre)",
    ("zllm/text/gguf_pre_tokenizers.py", "llama4"): "a GGUF pre-tokenizer (tokenizer.ggml.pre)",
    ("zllm/text/gguf_pre_tokenizers.py", "minimax-m2"): "a GGUF pre-tokenizer (tokenizer.ggml.pre)",
}


def architecture_names() -> set[str]:
    names = {n for f in registry.FAMILIES for n in (*f.model_types, *f.gguf_architectures)}
    spellings = transformers_family.GGUF_SPELLINGS
    return names | set(transformers_family.ENCODER_GGUF) | set(spellings) | set(spellings.values())


def named_architectures(path: Path, names: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each string literal in the module that is an architecture's name."""
    tree = parse_python(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append((node.lineno, node.value))
    return found


def test_architecture_names_appear_only_in_the_families_and_the_registry():
    names = architecture_names()
    bad = []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel.startswith(HOMES):
                continue
            for line, name in named_architectures(path, names):
                if (rel, name) not in OTHER_NAMESPACES:
                    bad.append(f"{rel}:{line}: {name!r}")
    assert not bad, "architecture names outside the families and the registry:\n" + "\n".join(bad)


def test_the_checker_finds_a_name_in_a_comparison(tmp_path):
    module = tmp_path / "m.py"
    module.write_text('def f(arch):\n    return arch.architecture == "qwen3"\n')
    assert named_architectures(module, architecture_names()) == [(2, "qwen3")]


def test_each_name_belongs_to_one_family():
    """A config.json model_type names one family; GGUF names are shared only where each
    family claims its own files (Mixtral's "llama" files have experts)."""
    types = [t for f in registry.FAMILIES for t in f.model_types]
    assert len(types) == len(set(types))
    for arch in {a for f in registry.FAMILIES for a in f.gguf_architectures}:
        sharing = [f for f in registry.FAMILIES if arch in f.gguf_architectures]
        assert len(sharing) == 1 or all(f.claims_gguf is not None for f in sharing), arch
    names = [f.name for f in registry.FAMILIES]
    assert len(names) == len(set(names)) and registry.TRANSFORMERS.name not in names


def test_every_family_says_where_its_code_lives_and_why_it_lacks_what_it_lacks():
    for family in (*registry.FAMILIES, registry.TRANSFORMERS):
        module, _, cls = family.model_class.partition(":")
        assert module.startswith("zllm.executor.models.") and cls, family.name
        assert family.code in ("zllm", "transformers")
        assert all(isinstance(f, Feature) and why for f, why in family.lacks.items())
        assert family.read_hf is not None or family.read_gguf is not None


def test_a_refusal_names_the_option_the_reason_the_capability_and_the_family():
    family = registry.family_named("deepseek_v2")
    assert family.refusal(Feature.TENSOR_PARALLEL, "--tensor-parallel-size 2") == (
        "--tensor-parallel-size 2: the latent attention's heads are not split over ranks yet "
        "(the DeepSeek-V2/V3 family (deepseek_v2) has no tensor parallelism)"
    )


def _gguf(path: Path, arch: str, **extra: int) -> str:
    writer = GGUFWriter(str(path), arch)
    for key, value in extra.items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def test_gguf_files_find_their_family_by_name_and_claim(tmp_path):
    dense = read_gguf(_gguf(tmp_path / "dense.gguf", "llama"))
    experts = read_gguf(_gguf(tmp_path / "moe.gguf", "llama", expert_count=8))
    other = read_gguf(_gguf(tmp_path / "rwkv.gguf", "rwkv7"))
    assert registry.family_for_gguf(dense).name == "llama"
    assert registry.family_for_gguf(experts).name == "mixtral"
    assert registry.family_for_gguf(other) is None


class _Entries:
    """Which modules of zllm.model a call enters, in order: a call from one module into
    another (of zllm.model's logic) is an entry; the records (arch_config, family) and the
    parsed GGUF file's own methods are data, not stops on the way."""

    DATA = ("zllm.model.arch_config", "zllm.model.family", "zllm.model.gguf")

    def __init__(self) -> None:
        self.entries: list[str] = []

    def __call__(self, frame, event, arg) -> None:
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
        if not callee.startswith("zllm.model") or callee == caller or callee in self.DATA:
            return
        self.entries.append(callee)


@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_reading_a_model_enters_each_module_once(tmp_path, form):
    """registry -> family -> back: the path from arch_of to the record enters each module of
    zllm.model once (a Qwen3-MoE: its family module, the shared readers, the experts')."""
    if form == "hf":
        path = str(write_tiny_model(tmp_path / "m", "qwen3_moe", weights=False))
    else:
        path = _gguf(
            tmp_path / "m.gguf", "qwen3moe", expert_count=4, expert_used_count=2,
            expert_feed_forward_length=8, block_count=1, embedding_length=4,
            feed_forward_length=8, context_length=16,
            **{"attention.head_count": 1, "attention.layer_norm_rms_epsilon": 1},
        )  # fmt: skip
    arch_of(path)  # (imports and caches warmed: the path is what the second read takes)
    entries = _Entries()
    sys.setprofile(entries)
    try:
        arch = arch_of(path)
    finally:
        sys.setprofile(None)
    assert arch.family == "qwen3_moe" and arch.moe is not None
    assert "zllm.model.registry" in entries.entries
    assert "zllm.model.families.qwen3_moe" in entries.entries
    again = sorted({m for m in entries.entries if entries.entries.count(m) > 1})
    assert not again, f"modules entered more than once: {again} (path: {entries.entries})"


def test_the_record_crosses_processes_whole(tmp_path):
    """EngineConfig reaches the executor's ranks through msgspec: a record with experts and a
    family's own fields (Gemma 3's) comes back equal, its family's record typed again."""
    import msgspec

    from zllm.model.families.gemma3 import Gemma3Fields

    moe = arch_of(str(write_tiny_model(tmp_path / "moe", "qwen3_moe", weights=False)))
    gemma = dataclasses.replace(
        moe, family="gemma3", moe=None, family_fields=Gemma3Fields(16.0, 1e4)
    )
    for arch in (moe, gemma):
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(arch), type=type(arch))
        assert back == arch and type(back.family_fields) is type(arch.family_fields)


def test_transformers_code_runs_a_native_family_that_stays_itself(tmp_path):
    """--model-impl transformers on a native family: the record keeps its family (its traits,
    parsers and tensor names), the code's capabilities are the transformers backend's, and
    a base model's checkpoint still has no LM head, as its own family reads it."""
    from safetensors.numpy import save_file

    path = write_tiny_model(tmp_path / "q", "qwen3", weights=False)
    arch = arch_of(str(path), "transformers")
    assert arch.family == "qwen3" and registry.family_of(arch).name == "qwen3"
    assert registry.code_family(arch, "transformers") is registry.TRANSFORMERS
    assert registry.code_family(arch, "zllm").name == "qwen3"
    bert = dataclasses.replace(arch, family="bert")  # a family on transformers' code anyway
    assert registry.code_family(bert, "transformers").name == "bert"
    save_file({"embed_tokens.weight": np.zeros((2, 2), np.float32)}, str(path / "model.safetensors"))  # fmt: skip
    for impl in ("zllm", "transformers"):
        assert not arch_of(str(path), impl).lm_head, impl


def test_a_native_classifier_on_transformers_code_is_refused_naming_the_option(tmp_path):
    import json

    path = write_tiny_model(tmp_path / "c", "qwen3", weights=False)
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["Qwen3ForSequenceClassification"]
    (path / "config.json").write_text(json.dumps(config))
    assert arch_of(str(path), "zllm").num_labels == 2
    with pytest.raises(ValueError, match="--model-impl transformers runs classifier heads of encoders only"):  # fmt: skip
        arch_of(str(path), "transformers")
