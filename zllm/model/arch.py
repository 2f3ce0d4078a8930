"""A model's record for the engine (`ModelArchConfig`), read from its files by its family:

    arch_of(path, requested)  -> impl.choose_model_impl: the file opened once, its family found
                                 in the registry, the code chosen
                              -> the family's reader (zllm/model/families/, over the shared
                                 hf_config / gguf_config / moe_arch readers)
                              -> back here: the heads a checkpoint carries (a classifier's
                                 labels, a base model's none) and a named model's stop tokens

No torch here.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

from zllm.model.arch_config import ModelArchConfig
from zllm.model.checkpoint_names import is_base_model
from zllm.model.family import Family, Feature
from zllm.model.files import registry_entry_of
from zllm.model.gguf import GGUFFile, invalid_gguf
from zllm.model.impl import ModelImpl, choose_model_impl, refuse_unreadable_gguf
from zllm.model.registry import (
    classifier_families_text,
    native_gguf_architectures,
    native_model_types,
)


def arch_of(model_path: str, requested: str = "auto") -> ModelArchConfig:
    """The record of whichever code `requested` picks (benchmarks, tools)."""
    return read_model_arch(model_path, choose_model_impl(model_path, requested))


def read_arch_config(model_path: str) -> ModelArchConfig:
    """The record zllm's own model code runs the model with (ValueError naming the
    architectures it runs when it runs none of this one's)."""
    impl = choose_model_impl(model_path, "zllm")
    if impl.reader is None:
        raise ValueError(_unsupported(model_path, impl))
    return read_model_arch(model_path, impl)


def read_model_arch(model_path: str, impl: ModelImpl) -> ModelArchConfig:
    """The record the engine runs `model_path` with under `impl`: read by its family's reader
    (a native family's reads its models whichever code runs them; the record's `family` stays
    that family, and registry.code_family says whose code runs it)."""
    reader, source = impl.reader, impl.source
    if reader is None:
        _refuse_foreign(model_path, impl)
    if isinstance(source, GGUFFile):
        if reader.read_gguf is None:
            raise ValueError(f"{model_path}: zllm reads no GGUF files of the {reader.title} family")
        return _with_stop_tokens(reader.read_gguf(source), model_path, source)
    directory = Path(model_path)
    arch = reader.read_hf(source, directory / "config.json")
    return _with_heads(arch, directory, reader, impl.family or reader)


def _refuse_foreign(model_path: str, impl: ModelImpl) -> None:
    """--model-impl zllm for an architecture zllm's own code does not run: ValueError naming
    what it runs, and what runs this one instead."""
    if isinstance(impl.source, GGUFFile) and importlib.util.find_spec("transformers"):
        refuse_unreadable_gguf(impl.source, None)  # nothing runs it: say so instead
    problem = _unsupported(model_path, impl)
    raise ValueError(
        f"{problem}; --model-impl transformers (or auto) runs it with transformers' modeling code"
    )


def _unsupported(model_path: str, impl: ModelImpl) -> str:
    """What zllm's own code runs, where it runs none of this model's architecture."""
    if not isinstance(impl.source, GGUFFile):
        return (
            f"{Path(model_path) / 'config.json'}: unsupported model_type {impl.architecture!r} "
            f"(zllm runs {', '.join(native_model_types())})"
        )
    if "general.architecture" not in impl.source.metadata:
        raise invalid_gguf(impl.source.path, "missing metadata key 'general.architecture'")
    return (
        f"{model_path}: unsupported architecture {impl.architecture!r} (zllm runs GGUF files "
        f"of {', '.join(native_gguf_architectures())})"
    )


def sequence_labels(directory: Path) -> list[str]:
    """A `*ForSequenceClassification` checkpoint's labels in index order (id2label, else
    LABEL_i for num_labels); empty for any other model."""
    cfg = json.loads((directory / "config.json").read_text())
    if not any(
        str(a).endswith("ForSequenceClassification") for a in cfg.get("architectures") or []
    ):
        return []
    id2label = cfg.get("id2label") or {}
    count = len(id2label) or int(cfg.get("num_labels", 2))
    return [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]


def _with_heads(
    arch: ModelArchConfig, directory: Path, reader: Family, code: Family
) -> ModelArchConfig:
    """A classifier's score head in place of the LM head, or a base model's checkpoint (an
    embedding model's decoder) without one: it pools. `reader`: the model's family; `code`:
    the family whose code runs it (the transformers backend's under --model-impl
    transformers)."""
    where = directory / "config.json"
    labels = sequence_labels(directory)
    if labels and not code.supports(Feature.CLASSIFIER_HEAD):
        if code is not reader:  # a native family's classifier on transformers' code
            raise ValueError(
                f"{where}: a sequence-classification {arch.architecture} model: --model-impl "
                f"transformers runs classifier heads of encoders only; zllm's own code runs "
                f"this one (--model-impl auto)"
            )
        raise ValueError(
            f"{where}: a sequence-classification {arch.architecture} model: zllm runs "
            f"classifier heads on {classifier_families_text()}"
        )
    if reader.code != "zllm":  # the encoders' own head, transformers', on its [CLS]
        return dataclasses.replace(arch, lm_head=False, num_labels=len(labels)) if labels else arch
    if labels:  # zllm's models still build an LM head, which the tied embedding fills
        return dataclasses.replace(
            arch, tie_word_embeddings=True, lm_head=False, num_labels=len(labels)
        )
    if is_base_model(directory):
        return dataclasses.replace(arch, tie_word_embeddings=True, lm_head=False)
    return arch


def _with_stop_tokens(arch: ModelArchConfig, model_path: str, gguf: GGUFFile) -> ModelArchConfig:
    """A named model's extra stop tokens (zllm/model/files.py's registry: Gemma 3's
    <end_of_turn>, which its GGUF does not declare)."""
    entry = registry_entry_of(model_path)
    if entry is None or not entry.stop_tokens:
        return arch
    tokens = gguf.metadata.get("tokenizer.ggml.tokens") or []
    extra = [tokens.index(t) for t in entry.stop_tokens if t in tokens]
    return dataclasses.replace(arch, eos_token_ids=list(dict.fromkeys([*arch.eos_token_ids, *extra])))  # fmt: skip
