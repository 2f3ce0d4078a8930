"""Which code runs a model, and which family's reader makes its record:

    --model-impl zllm          our model code (executor/models/), for the families that have it
    --model-impl transformers  transformers' modeling code with our paged attention plugged in
                               (executor/models/transformers/backend.py)
    --model-impl auto          ours when the model's family has it, else transformers'

The model's files are opened once here (config.json, or a GGUF file's header) and their family
found in the registry; zllm/model/arch.py then reads the record with that family's reader. No
torch here.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zllm.model.family import Family, Feature
from zllm.model.gguf import GGUFFile, read_gguf
from zllm.model.registry import (
    TRANSFORMERS,
    family_for_config,
    family_for_gguf,
    native_gguf_architectures,
    transformers_gguf_spelling,
)
from zllm.model.transformers_config import transformers_gguf_architectures

MODEL_IMPLS = ("auto", "zllm", "transformers")


@dataclass(frozen=True, slots=True)
class ModelImpl:
    """The code chosen for a model, and why (logged once at startup)."""

    name: str  # "zllm" or "transformers"
    architecture: str  # config.json's model_type or the GGUF general.architecture
    reason: str
    # The family whose reader makes the record (a native family's reader reads its models
    # whichever code runs them), and the file it reads: config.json's dict or the GGUF header.
    reader: Family | None = None
    source: dict[str, Any] | GGUFFile | None = None
    # The family whose model code runs it: the reader's, or the transformers backend's for a
    # native family run with --model-impl transformers.
    family: Family | None = None


def read_config_json(directory: Path) -> dict[str, Any]:
    config_path = directory / "config.json"
    try:
        return json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from None


def open_model(model_path: str) -> tuple[str, dict[str, Any] | GGUFFile, Family | None]:
    """(its architecture name, its config.json or GGUF header, the family that claims it)."""
    if os.path.isdir(model_path):
        cfg = read_config_json(Path(model_path))
        return str(cfg.get("model_type")), cfg, family_for_config(cfg)
    gguf = read_gguf(model_path)
    return str(gguf.metadata.get("general.architecture")), gguf, family_for_gguf(gguf)


def choose_model_impl(model_path: str, requested: str = "auto") -> ModelImpl:
    if requested not in MODEL_IMPLS:
        raise ValueError(f"model_impl must be one of {', '.join(MODEL_IMPLS)}, got {requested!r}")
    arch, source, family = open_model(model_path)
    native = family is not None and family.code == "zllm"
    if requested == "zllm" or (requested == "auto" and native):
        own = family if native else None  # (None: zllm/model/arch.py refuses it, naming why)
        return ModelImpl("zllm", arch, "zllm's model code", own, source, own)
    if importlib.util.find_spec("transformers") is None:
        why = (
            "--model-impl transformers"
            if requested == "transformers"
            else f"zllm has no native code for {arch!r}; running it"
        )
        raise ValueError(
            f"{model_path}: {why} needs transformers: pip install 'zllm[transformers]'"
        )
    if native and not family.supports(Feature.TRANSFORMERS_IMPL):
        refusal = family.refusal(Feature.TRANSFORMERS_IMPL, "--model-impl transformers")
        raise ValueError(f"{arch} cannot run with {refusal}")
    if isinstance(source, GGUFFile):
        refuse_unreadable_gguf(source, family)
    reader = family or TRANSFORMERS
    code = reader if reader.code == "transformers" else TRANSFORMERS
    if requested == "transformers":
        reason = "transformers' model code, as asked"
        return ModelImpl("transformers", arch, reason, reader, source, code)
    reason = f"transformers' model code (zllm has no native code for {arch!r})"
    return ModelImpl("transformers", arch, reason, reader, source, code)


def refuse_unreadable_gguf(gguf: GGUFFile, family: Family | None) -> None:
    """ValueError naming a GGUF file's architecture when neither zllm's code nor transformers'
    GGUF reader runs it (transformers would fail deep in its loader), and what runs instead."""
    problem = family.transformers_gguf_problem(gguf) if family and family.transformers_gguf_problem else None  # fmt: skip
    if problem:
        raise ValueError(
            f"{gguf.path}: {problem}; zllm's own code runs it (--model-impl auto or zllm)"
        )
    arch = str(gguf.metadata.get("general.architecture"))
    readable = transformers_gguf_architectures()
    if any(name in readable for name in transformers_gguf_spelling(arch)):
        return
    raise ValueError(
        f"{gguf.path}: GGUF architecture {arch!r} runs neither in zllm's own code (GGUF files "
        f"of {', '.join(native_gguf_architectures())}) nor through transformers' GGUF reader "
        f"({', '.join(readable)}); the original checkpoint's Hugging Face directory (config.json "
        f"and safetensors) may run with --model-impl transformers"
    )
